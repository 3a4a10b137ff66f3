"""``deltacast bench core``, its JSON rows, the v1 baseline and the synthetic workloads.

Timings are never asserted (2 noisy cores); bytes are deterministic and are.
"""

from __future__ import annotations

import importlib.machinery
import json
import re
import sys
import types
from collections import Counter

import numpy as np
import pytest

from engine_side.bench import baselines, cli
from engine_side.bench.core import FORMATS, QUICK_BATCHES, SCENARIOS, check_targets
from engine_side.bench.rows import ROW_KEYS, make_row, row_problems
from engine_side.cli import main
from engine_side.mirror import EngineMirror
from engine_side.request_diff import RequestDiffer
from engine_side.workloads import SCENARIOS as WORKLOADS
from engine_side.workloads import Workload
from protocol import codec
from protocol.messages import NewRequest
from protocol.rebuild import rebuild_request
from protocol.request import ExecuteModelRequest, RequestSpec, request_differences
from protocol.state import ReplicaState
from worker_side.events import Applied
from worker_side.replica import WorkerReplica


@pytest.fixture(scope="module")
def quick_rows() -> list[dict[str, object]]:
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "--quick", "--json", "--steps", "4"]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_every_row_has_the_schema(quick_rows: list[dict[str, object]]) -> None:
    assert quick_rows
    for row in quick_rows:
        assert list(row)[: len(ROW_KEYS)] == list(ROW_KEYS)
        assert row_problems(row) == [], row


def test_every_case_has_every_format(quick_rows: list[dict[str, object]]) -> None:
    formats = Counter((r["scenario"], r["batch"]) for r in quick_rows)
    assert set(formats) == {(s, b) for s in SCENARIOS for b in QUICK_BATCHES}
    for case in formats:
        got = [str(r["format"]) for r in quick_rows if (r["scenario"], r["batch"]) == case]
        assert sorted(got) == sorted(FORMATS), case


def test_byte_targets(quick_rows: list[dict[str, object]]) -> None:
    for row in quick_rows:
        if row["format"] == "deltacast" and row["scenario"] == "steady_decode":
            assert row["bytes_max"] <= 32, row  # type: ignore[operator]
        if row["format"] == "pickle_v1":
            assert row["baseline"] in ("vllm", "standin")
    targets = {t.what: t for t in check_targets(quick_rows)}
    assert targets["decode_tokens_blocks bytes/step, batch 256"].met
    assert "steady_decode time vs pickle_v1, batch 256" in targets  # evaluated, not asserted


def test_row_problems_catches_bad_rows() -> None:
    good = make_row("s", 1, 1, "f", 10, 1.0, 2.0)
    assert good["total_us"] == 3.0 and row_problems(good) == []
    assert row_problems({k: v for k, v in good.items() if k != "bytes"}) == ["missing key 'bytes'"]
    assert row_problems({**good, "batch": "1"}) == ["batch has type str"]
    assert row_problems({**good, "total_us": 4.0}) == [
        "total_us differs from encode_us + decode_us"]
    assert row_problems(make_row("s", None, None, "f", None, None, None)) == []


def test_missing_kind_exits_2(capsys: pytest.CaptureFixture[str],
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "_available", lambda kind: kind == "core")
    assert main(["bench", "latency"]) == 2
    assert "not available yet" in capsys.readouterr().err


def test_existing_kind_is_delegated(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("engine_side.bench.mm")
    fake.__spec__ = importlib.machinery.ModuleSpec("engine_side.bench.mm", None)
    fake.run = lambda args: 7 if args.kind == "mm" else 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "engine_side.bench.mm", fake)
    assert main(["bench", "mm", "--json"]) == 7


# -- the v1 stand-in -------------------------------------------------------------------
def test_v1_steady_step_sends_only_cached_rows() -> None:
    workload = Workload("steady_decode", 8, seed=3)
    v1 = baselines.V1Scheduler()
    first = v1.convert(next(workload.warmup()))
    assert len(first.scheduled_new_reqs) == 8 and first.scheduled_cached_reqs.req_ids == []
    step = v1.convert(workload.step())
    cached = step.scheduled_cached_reqs
    assert step.scheduled_new_reqs == [] and len(cached.req_ids) == 8
    assert cached.new_block_ids == [None] * 8 and cached.new_token_ids == []
    assert step.num_scheduled_tokens == dict.fromkeys(cached.req_ids, 1)
    message = baselines.rpc_message(step)
    frames = baselines.pickle_frames(message)
    assert baselines.unpickle_frames(frames) == message


def test_v1_engine_tokens_and_blocks() -> None:
    workload = Workload("decode_tokens_blocks", 64, seed=4)
    v1 = baselines.V1Scheduler()
    for req in workload.warmup():
        v1.convert(req)
    cached = v1.convert(workload.step()).scheduled_cached_reqs
    assert all(len(t) == 1 for t in cached.new_token_ids) and len(cached.new_token_ids) == 64
    assert sum(b is not None for b in cached.new_block_ids) == 64 // 16


# -- workloads --------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", sorted(WORKLOADS))
def test_workload_rebuilds_exactly(scenario: str) -> None:
    """Every step of every workload crosses the wire (RequestDiffer → codec → a replica
    started without a snapshot) and is rebuilt equal to the engine's request; the
    changes the workload knows (what ``bench core`` steps its mirror with) lead a second
    mirror to the same state, step by step."""
    workload = Workload(scenario, 24, seed=5)
    mirror = EngineMirror(token_mode=workload.token_mode)
    differ = RequestDiffer(mirror)
    direct = EngineMirror(token_mode=workload.token_mode, keep_tables=False)
    replica = WorkerReplica(silence_timeout=float("inf"), start=(
        mirror.epoch, ReplicaState(workload.token_mode)))
    specs: dict[int, tuple[NewRequest, RequestSpec]] = {}
    sizes = []

    def check(req: ExecuteModelRequest) -> None:
        frames = codec.encode(differ.diff(req))
        sizes.append(codec.encoded_size(frames))
        events = replica.receive(codec.decode(frames), 0.0)
        assert isinstance(events[-1], Applied), events
        assert replica.data is not None and replica.last is not None
        assert replica.applied is not None
        got = rebuild_request(replica.data, replica.last.body, replica.applied, specs)
        assert request_differences(got, req) == []
        direct.step(**workload.changes)
        assert direct.state.digest == mirror.state.digest == replica.data.digest

    for req in workload.warmup():
        check(req)
    for _ in range(40):
        check(workload.step())
    assert replica.seq == mirror.seq == len(sizes)


def test_workload_shapes() -> None:
    workload = Workload("decode_tokens_blocks", 32, seed=6)
    warm = list(workload.warmup())
    a, b = workload.step(), workload.step()
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{16}-[0-9a-f]{8}", i) for i in a.req_ids)
    assert all(x is y for x, y in zip(a.specs, b.specs, strict=True))  # one spec per request
    prompts = [s.prompt_token_ids.size for s in a.specs]  # type: ignore[union-attr]
    assert min(prompts) >= 192 and max(prompts) < 512
    assert int((b.block_tables[0].lengths - a.block_tables[0].lengths).sum()) == 32 // 16
    assert [len(t) for t in b.output_token_ids] == [len(t) + 1 for t in a.output_token_ids]  # type: ignore[union-attr]
    assert np.array_equal(b.num_computed_tokens, a.num_computed_tokens + 1)
    assert min(len(t) for t in warm[-1].output_token_ids) >= 16  # type: ignore[union-attr]


def test_workload_is_seeded() -> None:
    a = Workload("mixed_chat", 16, seed=9)
    b = Workload("mixed_chat", 16, seed=9)
    for _ in range(30):
        x, y = a.step(), b.step()
        assert x.req_ids == y.req_ids
        assert np.array_equal(x.block_tables[0].values, y.block_tables[0].values)


def test_steady_decode_keeps_tables() -> None:
    workload = Workload("steady_decode", 16, seed=7)
    list(workload.warmup())
    a = workload.step()
    for _ in range(50):
        b = workload.step()
    assert np.array_equal(a.block_tables[0].values, b.block_tables[0].values)
    assert b.output_token_ids is None and not b.finished_req_ids


def test_ring_copies_write_every_buffer_and_read_the_out_of_band_ones() -> None:
    """The bitmask benchmark's account of vLLM's shared-memory ring: every buffer is
    written after its 4-byte length, and the reader gets copies of the out-of-band
    buffers (not views of the ring)."""
    from engine_side.bench.bitmask import ring_copies

    buffers = [b"pickle bytes", bytes(range(256)) * 5000, memoryview(b"\x07" * 3000)]
    ring = bytearray(2_000_000)
    seconds, out = ring_copies(buffers, ring)
    assert seconds >= 0
    assert out == [bytearray(buffers[1]), bytearray(buffers[2])]
    assert all(type(b) is bytearray for b in out)
    assert ring[3:7] == len(buffers[0]).to_bytes(4, "big")
    assert ring[7:7 + len(buffers[0])] == buffers[0]
    at = 7 + len(buffers[0])
    assert ring[at:at + 4] == len(buffers[1]).to_bytes(4, "big")
    out[0][0] = 99  # a copy: the ring keeps the writer's bytes
    assert ring[at + 4] == 0
