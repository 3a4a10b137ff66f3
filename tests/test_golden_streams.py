"""Object streams (``engine_side/bench/objstream.py``) and the golden corpus of vLLM streams.

(a) every golden file loads and holds vLLM objects of each record's kind; (b) the
objects round-trip through objstream exactly, as do Hypothesis streams; (c) the
adapter of today rebuilds every golden record exactly (the corpus is valid input).
Regenerate the corpus with ``python tests/golden_streams.py`` (see there).
"""

from __future__ import annotations

import copy
import re
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from golden_streams import ALLOW, REAL, SYNTHETIC, golden_streams  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm_equal import assert_vllm_equal  # noqa: E402
from vllm_streams import OpaqueMeta, scheduler_streams  # noqa: E402

from engine_side.bench.objstream import (  # noqa: E402
    KINDS,
    MAGIC,
    dumps,
    loads,
    read_stream,
    write_stream,
)

pytestmark = pytest.mark.vllm
SECRET = b"k" * 32
EXPECTED: dict[str, tuple[type, ...]] = {
    "execute_model": (SchedulerOutput,), "sample_tokens": (GrammarOutput, type(None)),
    "reply": (ModelRunnerOutput, type(None)), "sample_reply": (ModelRunnerOutput, type(None))}


def test_every_golden_file_loads_with_vllm_objects_of_its_kinds() -> None:
    streams = golden_streams()
    assert set(streams) == {*REAL, *SYNTHETIC}
    for name, (meta, records) in streams.items():
        assert meta["scenario"] == name and meta["regenerate"] and meta["what"]
        kinds = [k for k, _ in records]
        assert kinds[:1] == ["execute_model"] and set(kinds) <= set(KINDS), name
        for kind, obj in records:
            assert isinstance(obj, EXPECTED[kind]), (name, kind, type(obj))
        # a step: execute_model and its reply, then (unless the batch was empty)
        # sample_tokens and its reply
        assert re.fullmatch(r"(er(ss)?)+", "".join(k[0] for k in kinds)), name
        if name in REAL:
            assert meta["vllm"].startswith("0.32") and meta["stats"]["steps"] == kinds.count(
                "execute_model")
    seen = {name: meta["stats"] for name, (meta, _) in streams.items() if name in REAL}
    assert all(seen[n]["join_steps"] > 10 and seen[n]["leave_steps"] > 10
               for n in REAL if n.startswith("golden16")), seen
    assert seen["main"]["preempt_steps"] and seen["main"]["resume_steps"]
    assert any(g is not None for _, g in streams["main"][1] if isinstance(g, GrammarOutput))
    assert any(so.scheduled_spec_decode_tokens for k, so in streams["spec"][1]
               if k == "execute_model")
    assert streams["golden16_async"][0]["async_scheduling"]


def test_golden_objects_round_trip_through_objstream(tmp_path: Path) -> None:
    for name, (meta, records) in golden_streams().items():
        for _, obj in records:
            assert_vllm_equal(obj, loads(dumps(obj, allow=ALLOW), allow=ALLOW))
        path = tmp_path / f"{name}.dcobj"
        write_stream(path, records, meta, allow=ALLOW)
        again_meta, again = read_stream(path, allow=ALLOW)
        assert again_meta == meta
        assert_vllm_equal(records, again)


@settings(max_examples=30)
@given(stream=scheduler_streams())
def test_generated_streams_round_trip_through_files_exactly(stream: dict[str, Any]) -> None:
    records = [("execute_model", so) for so in stream["steps"]]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "s.dcobj"
        write_stream(path, records, {"v2": stream["v2"], "kv_groups": stream["kv_groups"]},
                     allow=ALLOW)
        meta, got = read_stream(path, allow=ALLOW)
    assert meta == {"v2": stream["v2"], "kv_groups": stream["kv_groups"]}
    assert_vllm_equal(records, got)


def test_values_come_back_exactly() -> None:
    import numpy as np
    import torch
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, logit_bias={5: 1.5, -1: -0.0}, stop=["x"], seed=2 ** 63)
    sp._all_stop_token_ids.add(7)
    values = [2 ** 64 - 1, -(2 ** 200), float("nan"), -0.0, {1: "a", "b": 2, (3,): None},
              {"@at": 1}, frozenset({1, "x"}), (), [(), set()], b"\x00", np.float32(1.5),
              np.arange(6, dtype=np.int16).reshape(2, 3), np.zeros((0, 4), np.int32),
              torch.tensor([1.5, -0.0], dtype=torch.bfloat16), torch.zeros(0), sp]
    got = loads(dumps(values))
    assert_vllm_equal(values, got)
    assert type(got[-1].temperature) is int and got[-1]._all_stop_token_ids == {7}
    assert str(got[3]) == "-0.0" and list(got[4]) == [1, "b", (3,)]


def test_unlisted_classes_are_refused_both_ways(tmp_path: Path) -> None:
    so = SchedulerOutput.make_empty()
    so.kv_connector_metadata = OpaqueMeta("kv", [1])  # type: ignore[assignment]
    with pytest.raises(ValueError, match="vllm_streams:OpaqueMeta"):
        dumps(so)
    path = tmp_path / "s.dcobj"
    write_stream(path, [("execute_model", so)], {}, allow=ALLOW)
    with pytest.raises(ValueError, match="refuses class 'vllm_streams:OpaqueMeta'"):
        read_stream(path)
    for tree in ({"@": "os:system"}, {"@": "builtins:dict"}, {"@e": ["subprocess:Popen", 1]},
                 {"@": "vllm.v1.core.sched.output:SchedulerOutput", "bogus": 1}):
        with pytest.raises(ValueError, match="objstream"):
            loads(msgspec.msgpack.encode(tree))
    with pytest.raises(ValueError, match="function"):
        dumps([len])
    other = tmp_path / "x.bin"
    other.write_bytes(b"\x80\x04not an object stream")
    with pytest.raises(ValueError, match="bad magic"):
        read_stream(other)
    other.write_bytes(MAGIC + b"\xff\x00\x00\x00abc")
    with pytest.raises(ValueError, match="truncated"):
        read_stream(other)
    other.write_bytes(MAGIC + b"\x03\x00\x00\x00abc")
    with pytest.raises(ValueError, match="malformed"):
        read_stream(other)
    for bad in ({"@t": 5}, {"@d": [1]}, {"@nd": ["<i4", [3], b"\x00"]}, {"@pt": ["int8"]}):
        with pytest.raises(ValueError):
            loads(msgspec.msgpack.encode(bad))
    with pytest.raises(ValueError, match="kind"):
        write_stream(path, [("execute", so)], {})


def test_todays_adapter_rebuilds_every_golden_record() -> None:
    """The corpus is valid adapter input: each record through an encoder / decoder pair
    comes back exactly (execute_model and sample_tokens engine -> worker, replies back)."""
    from engine_side.bench.vllm_replay import round_trip
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    for name, (meta, records) in golden_streams().items():
        enc = SchedulerOutputEncoder(meta.get("kv_groups"), secret=SECRET)
        dec = SchedulerOutputDecoder(secret=SECRET)
        for i, (kind, obj) in enumerate(records):
            expected = copy.deepcopy(obj)
            got = round_trip(enc, dec, kind, obj)
            try:
                assert_vllm_equal(expected, got)
            except AssertionError as exc:
                raise AssertionError(f"{name} record {i} ({kind}): {exc}") from None
