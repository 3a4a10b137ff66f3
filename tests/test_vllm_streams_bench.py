"""Smoke tests of the vLLM-streams benchmark machinery (replay, JSON document, tables).

The verdict logic is checked on a hand-made document (no vLLM needed); the rest
runs on a tiny synthetic stream written to a real recording file, so it takes a
second.  Parts that need vLLM are skipped cleanly when it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from engine_side.bench.vllm_table import kinds, render, targets

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")


def _path(nbytes: int, pbytes: int, us: float = 10.0, pus: float = 20.0) -> dict[str, Any]:
    return {"bytes": nbytes, "pickle_bytes": pbytes, "us": us, "pickle_us": pus,
            "median_bytes": nbytes, "pickle_median_bytes": pbytes, "median_us": us,
            "pickle_median_us": pus}


def _stream(nbytes: int, pbytes: int, running: int = 4, steady: int | None = 16,
            ) -> dict[str, Any]:
    return {"steps": 10, "max_running": running, "request": _path(nbytes, pbytes),
            "reply": _path(nbytes, pbytes * 2),
            "steady": {"steps": 3, "max_over_blocks": steady, "within_32": 2,
                       "median_bytes": steady},
            "reply_at_max_running": {"steps": 2, "median_bytes": 10, "pickle_median_bytes": 95}}


def _doc() -> dict[str, Any]:
    workloads = {"decode": _stream(100, 1000, running=256), "chunked": _stream(100, 700),
                 "prefix": _stream(100, 700, steady=40)}
    total = {p: {k: sum(w[p][k] for w in workloads.values())
                 for k in ("bytes", "pickle_bytes", "us", "pickle_us")}
             for p in ("request", "reply")}
    return {"meta": {"date": "today", "commit": "abc", "load": 1.0}, "workloads": workloads,
            "synthetic": {}, "total": total}


def test_targets_judge_each_limit() -> None:
    verdicts = {t["target"]: t["met"] for t in targets(_doc())}
    assert verdicts["decode: × fewer request bytes"] is True  # 10× ≥ 8×
    assert verdicts["chunked: × fewer request bytes"] is True  # 7× ≥ 6× (its own limit)
    assert verdicts["prefix: × fewer request bytes"] is False  # 7× < 8×
    assert verdicts["all recorded: × fewer request bytes"] is False  # 8× < 15×
    assert verdicts["prefix: steady decode B − 4/new block (worst of 3; 2 within)"] is False
    assert verdicts["decode: steady decode B − 4/new block (worst of 3; 2 within)"] is True
    assert verdicts["decode: × fewer reply bytes at 256 requests (median of 2 steps)"] is False
    assert all(v for k, v in verdicts.items() if "µs" in k)  # 10 µs against 20
    # the churn streams (ours, a join and a finish every step) are reported, not judged
    doc = _doc()
    doc["synthetic"] = {"churn-16": _stream(100, 1000), "256": _stream(100, 1000, 256)}
    doc["synthetic"]["churn-16"]["request"]["median_us"] = 100.0  # 5× pickle's 20
    judged = {t["target"]: t for t in targets(doc)}
    churn = judged["synthetic-churn-16: median µs ÷ pickle (worst case, no target)"]
    assert churn["met"] is None and churn["value"] == 5.0 and churn["limit"] == "–"
    assert judged["synthetic-256: median µs ÷ pickle"]["met"] is True  # 0.5 ≤ 0.5
    assert "| 5.0 | – | reported |" in render(doc)


def test_render_has_one_row_per_stream_and_the_totals() -> None:
    text = render(_doc())
    assert "by step kind" in text  # documents without step kinds: a table without rows
    for name in ("decode", "chunked", "prefix", "**all recorded**"):
        assert text.count(f"| {name} |") == 2  # request and reply tables
    assert "**8.0×**" in text and "**not met**" in text
    # the baseline is named: a document without one is from the bare-pickle sessions
    assert "pickle = bare pickle.dumps + loads)" in text
    doc = _doc()
    doc["meta"]["baseline"] = "vLLM's MessageQueue serializer"
    assert "pickle = vLLM's MessageQueue serializer)" in render(doc)


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic stream written as a real recording (what a live run would write)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from engine_side.bench.vllm_replay import synthetic_decode
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from engine_side.vllm.record import RecordWriter
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    path = tmp_path_factory.mktemp("streams") / "tiny.dcrec"
    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    with RecordWriter(path, meta={"scenario": "tiny"}, vllm_version="0.32.0") as writer:
        for kind, obj in synthetic_decode(8, 40, prompt=64):
            if kind == "execute_model":
                frames = enc.encode(obj)
                dec.decode([bytes(f) for f in frames])
            else:
                frames = dec.encode_reply(obj)
            writer.write(kind, [bytes(f) for f in frames])
    return path


@pytest.mark.vllm
@needs_vllm
def test_replay_document_from_a_recording(recording: Path) -> None:
    from engine_side.bench.vllm_streams import replay_all

    doc = {"meta": {}, **replay_all({"tiny": recording}, [8], churn=(8,))}
    tiny = doc["workloads"]["tiny"]
    assert tiny["steps"] == 40 and tiny["max_running"] == 8
    assert 0 < tiny["request"]["bytes"] < tiny["request"]["pickle_bytes"]
    assert 0 < tiny["reply"]["bytes"] < tiny["reply"]["pickle_bytes"]
    assert tiny["steady"]["steps"] > 20
    assert tiny["steady"]["median_bytes"] == 14  # most steady steps: the header-only Delta
    assert sum(tiny["request_fields"].values()) == tiny["request"]["bytes"]  # exact accounting
    assert doc["synthetic"]["8"]["steps"] == 20
    assert doc["synthetic"]["churn-8"]["steps"] == 20
    assert "| synthetic-churn-8 | 20 |" in render(doc)
    assert doc["total"]["request"]["bytes"] == tiny["request"]["bytes"]
    assert "| tiny | 40 |" in render(doc)
    churn = doc["synthetic"]["churn-8"]
    assert churn["churn"]["steps"] == 20 and churn["same_batch"]["steps"] == 0
    assert tiny["churn"]["steps"] == 1 and tiny["same_batch"]["steps"] == 39
    assert sum(tiny[k]["us"] for k in ("churn", "same_batch")) == \
        pytest.approx(tiny["request"]["us"])
    assert "| synthetic-churn-8 | 20 |" in kinds(doc) and "| 0 | – | – | – |" in kinds(doc)


@pytest.mark.vllm
@needs_vllm
def test_churn_stream_round_trips_and_every_step_is_general() -> None:
    """The continuous-batching stream: one request leaves and one joins each step."""
    from vllm_equal import assert_vllm_equal

    from engine_side.bench.vllm_replay import synthetic_churn
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(), SchedulerOutputDecoder()
    stream = synthetic_churn(8, 6, prompt=64)
    steps = [obj for kind, obj in stream if kind == "execute_model"]
    for so in steps:
        assert_vllm_equal(so, dec.decode([bytes(f) for f in enc.encode(so)]))
        assert len(so.num_scheduled_tokens) == 8
    assert [len(so.finished_req_ids) for so in steps] == [0] + [1] * 5
    assert enc.quick_steps == dec.quick_steps == 0
    assert [kind for kind, _ in stream].count("reply") == 5


@pytest.mark.vllm
@needs_vllm
def test_every_scenario_builds_its_requests() -> None:
    from engine_side.bench.vllm_scenarios import SCENARIOS, WORKLOADS

    assert len(WORKLOADS) == 8
    for scenario in SCENARIOS.values():
        prompts, params = scenario.requests()
        assert len(prompts) == len(params) > 0
        assert scenario.engine_kwargs()["block_size"] % 32 == 0


@pytest.mark.vllm
@needs_vllm
def test_diagnose_explains_a_recording(recording: Path) -> None:
    from engine_side.bench.vllm_diagnose import diagnose

    got = diagnose(recording)
    assert got["new_requests"] == 8 and got["new_request_bytes_per_key"]["i"] > 0
    steps, over = got["steady_by_new_blocks"][0]
    assert steps > 20 and over == 0  # header-only steady steps are within 32 B
    assert got["bitmask"] == {} and got["drafts"] == {}


@pytest.mark.vllm
@needs_vllm
def test_step_kinds_sort_every_step_of_a_recording(recording: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Every execute_model step lands in one kind; the synthetic decode stream is one
    general step (the first), then same-batch steps: the one right after it, header-only
    ones, and appends wherever a request crosses a block."""
    from engine_side.bench.vllm_step_kinds import KINDS, main, step_kinds

    got = step_kinds(recording, passes=2)
    assert set(got) <= set(KINDS)
    assert sum(k["steps"] for k in got.values()) == 40
    assert got["general"]["steps"] == 1 and got["steady"]["steps"] > 20
    assert got["after-change"]["steps"] == 1
    assert "appends" in got and "turnover" not in got
    assert all(k[f] > 0 for k in got.values() for f in ("encode_us", "decode_us", "pickle_us"))
    assert main([str(recording), "--passes", "1", "--json"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["recording"] == str(recording) and set(line["kinds"]) == set(got)
    with pytest.raises(SystemExit):
        main([str(recording.with_suffix(".missing"))])


@pytest.mark.vllm
@needs_vllm
def test_replay_passes_take_each_steps_median_of_both_paths(
        recording: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With passes, each step's µs on either path is the median of its passes (the
    passes here report known figures); bytes are one pass's, the other path goes
    first in every other pass, and a pass count below one is refused."""
    from engine_side.bench import vllm_replay
    from engine_side.bench.vllm_replay import load_recording, replay

    messages = load_recording(recording)
    real = vllm_replay._one_pass
    orders: list[bool] = []

    def scripted(msgs: Any, breakdown: bool, ours_first: bool, bare: bool,
                 eviction: Any = None) -> Any:
        steps, fields = real(msgs, breakdown, ours_first, bare, eviction)
        k = len(orders)
        orders.append(ours_first)
        for i, step in enumerate(steps):  # pass k: µs (10k + i, 100k + i) per path
            for acc in step.figures.values():
                acc[2], acc[3] = 10.0 * k + i, 100.0 * k + i
        return steps, fields

    monkeypatch.setattr(vllm_replay, "_one_pass", scripted)
    one, three = replay(messages), replay(messages, passes=3)
    assert orders == [False, False, True, False]
    assert three["passes"] == 3 and three["steps"] == one["steps"] == 40
    assert three["request"]["bytes"] == one["request"]["bytes"]
    # step i of the three passes (k = 1, 2, 3) reads 10k + i: its median is 20 + i
    assert three["request"]["us"] == pytest.approx(sum(20.0 + i for i in range(40)))
    assert three["request"]["pickle_us"] == pytest.approx(sum(200.0 + i for i in range(40)))
    assert three["request"]["median_us"] == pytest.approx(20.0 + 19.5)
    with pytest.raises(ValueError, match="passes"):
        replay(messages, passes=0)


@pytest.mark.vllm
@needs_vllm
def test_step_kinds_count_finish_steps_apart(tmp_path: Path) -> None:
    """A stream whose requests finish a few at a time: those steps are their own kind,
    and so is each same-batch step that follows one (or the first, general, step)."""
    from test_vllm_finish import _finishes

    from protocol.speedups import C
    if C is None:
        pytest.skip("the engine's finish path needs the C speedups")

    from engine_side.bench.vllm_step_kinds import SAME_BATCH, step_kinds
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from engine_side.vllm.record import RecordWriter

    path, enc = tmp_path / "finishes.dcrec", SchedulerOutputEncoder()
    with RecordWriter(path, meta={"scenario": "finishes"}, vllm_version="0.32.0") as writer:
        for so in _finishes():
            writer.write("execute_model", [bytes(f) for f in enc.encode(so)])
    got = step_kinds(path, passes=1)
    assert got["finish"]["steps"] == 3 and "turnover" not in got
    # the second step (after the first), and the one after each lone finish step
    assert got["after-change"]["steps"] == 3 and not SAME_BATCH & set(got)
    assert got["general"]["steps"] == 2
    assert sum(k["steps"] for k in got.values()) == len(_finishes())


@pytest.mark.vllm
@needs_vllm
def test_the_pickle_baseline_runs_vllms_own_serializer(recording: Path) -> None:
    """``vllm_serialize`` / ``vllm_deserialize`` run the lines vLLM's MessageQueue runs:
    each is in vLLM's own source (a vLLM that changes them fails here).  Buffers under
    1 MiB stay in band and larger ones go out of band, both load back equal; without
    buffers the bytes are bare pickle's."""
    import inspect

    import numpy as np
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm_equal import differences

    from engine_side.bench import vllm_replay
    from engine_side.bench.vllm_replay import load_recording, pickled

    def flat(source: str) -> str:  # whitespace and trailing commas aside
        return " ".join(source.split()).replace(", )", ")").replace("( ", "(")

    theirs, ours = flat(inspect.getsource(MessageQueue.enqueue)), \
        flat(inspect.getsource(vllm_replay.vllm_serialize))
    for line in ("dispatch_table = dict(copyreg.dispatch_table)",
                 "dispatch_table[torch.Tensor] = _reduce_tensor",
                 "raw_buf = buf.raw()", "if len(raw_buf) < 1024 * 1024:",
                 "all_buffers.append(raw_buf)", "with io.BytesIO() as bio:",
                 "pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL, "
                 "buffer_callback=oob_callback)",
                 "pickler.dispatch_table = dispatch_table", "pickler.dump(obj)",
                 "all_buffers[0] = bio.getvalue()"):
        assert line in theirs and line in ours, line
    loads = "pickle.loads(all_buffers[0], buffers=all_buffers[1:])"
    assert loads in flat(inspect.getsource(MessageQueue.dequeue))
    assert loads in flat(inspect.getsource(vllm_replay.vllm_deserialize))

    big, small = np.arange(2**18, dtype=np.float64), np.arange(7)  # 2 MiB, 56 B
    sent = vllm_replay.vllm_serialize(("m", (big, small), {}, 0))
    assert len(sent) == 2 and memoryview(sent[1]).nbytes == big.nbytes
    back = vllm_replay.vllm_deserialize(sent)
    assert np.array_equal(back[1][0], big) and np.array_equal(back[1][1], small)
    so = next(obj for kind, obj in load_recording(recording) if kind == "execute_model")
    assert not differences(vllm_replay.vllm_deserialize(vllm_replay.vllm_serialize(so)), so)
    assert pickled("execute_model", so)[0] == pickled("execute_model", so, bare=True)[0]


@pytest.mark.vllm
@needs_vllm
def test_replay_times_the_chosen_baseline(recording: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's serializer by default, bare pickle when asked: every message of the pass
    is timed by the one chosen."""
    from engine_side.bench import vllm_replay
    from engine_side.bench.vllm_replay import load_recording, replay

    messages = load_recording(recording)[:12]
    chosen: list[bool] = []
    real = vllm_replay.pickled

    def pickled(kind: str, obj: Any, bare: bool = False) -> Any:
        chosen.append(bare)
        return real(kind, obj, bare)

    monkeypatch.setattr(vllm_replay, "pickled", pickled)
    replay(messages)
    assert len(chosen) == len(messages) and not any(chosen)
    chosen.clear()
    replay(messages, bare=True)
    assert len(chosen) == len(messages) and all(chosen)


@pytest.mark.vllm
@needs_vllm
def test_eviction_runs_before_each_paths_turn(recording: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With an Eviction, every timed turn -- ours and vLLM's, at every message -- follows
    its own eviction; without one, none runs."""
    from engine_side.bench import vllm_replay
    from engine_side.bench.vllm_replay import Eviction, load_recording, replay

    messages = load_recording(recording)[:12]
    log: list[str] = []
    real_pickled, real_ours, real_evictor = (vllm_replay.pickled, vllm_replay._ours,
                                             Eviction.evictor)

    def pickled(kind: str, obj: Any, bare: bool = False) -> Any:
        log.append("pickle")
        return real_pickled(kind, obj, bare)

    def ours(kind: str, obj: Any, route: Any) -> Any:
        log.append("ours")
        return real_ours(kind, obj, route)

    def evictor(self: Eviction) -> Any:
        evict = real_evictor(self)

        def logged(obj: Any) -> None:
            log.append("evict")
            evict(obj)
        return logged

    monkeypatch.setattr(vllm_replay, "pickled", pickled)
    monkeypatch.setattr(vllm_replay, "_ours", ours)
    monkeypatch.setattr(Eviction, "evictor", evictor)
    replay(messages)
    assert "evict" not in log and len(log) == 2 * len(messages)
    log.clear()
    replay(messages, eviction=Eviction(1, warm_step=True))
    assert log[0::2] == ["evict"] * (2 * len(messages))
    assert sorted(log[1::2]) == ["ours"] * len(messages) + ["pickle"] * len(messages)


def test_eviction_evicts_then_reads_the_step() -> None:
    """The evictor writes its buffer and, with warm_step, reads the object; a size
    outside 1..4096 MB is refused."""
    from engine_side.bench.vllm_replay import Eviction

    class Step:
        reads = 0

        def __repr__(self) -> str:
            Step.reads += 1
            return "step"

    Eviction(1).evictor()(Step())
    assert Step.reads == 0
    Eviction(1, warm_step=True).evictor()(Step())
    assert Step.reads == 1
    for mb in (0, -1, 4097):
        with pytest.raises(ValueError, match="eviction"):
            Eviction(mb)


def test_warm_step_needs_an_eviction(capsys: pytest.CaptureFixture[str]) -> None:
    """--warm-step alone is refused with a message, before anything is recorded."""
    import argparse

    from engine_side.bench import vllm_streams

    parser = argparse.ArgumentParser()
    vllm_streams.add_arguments(parser)
    assert vllm_streams.run(parser.parse_args(["--replay", "x.dcrec", "--warm-step"])) == 2
    assert "--evict-mb" in capsys.readouterr().err
