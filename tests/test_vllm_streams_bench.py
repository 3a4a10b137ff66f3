"""The vLLM-streams benchmark: replay, the JSON document, exactness checks, tables, targets.

The verdicts, tables and the page's converter are checked on a hand-made document
(no vLLM needed); the replay runs on the committed golden streams
(``tests/golden/streams``: real vLLM runs) and on small synthetic streams, so it
takes seconds on a fresh machine.  Parts that need vLLM are skipped cleanly when it
is not installed.  Timings are never asserted: only which figures go where.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from engine_side.bench import figures, page_tables, vllm_streams
from engine_side.bench.vllm_table import kinds, render, targets

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed")
GOLDEN = Path(__file__).resolve().parent / "golden" / "streams"
RECORDED = ("main", "golden16")  # real vLLM runs, no classes beyond vLLM's


def _path(steps: int, nbytes: int, vbytes: int, us: float, vus: float, bus: float,
          minimal: bool = True) -> dict[str, Any]:
    """One path's figures; the floor a quarter of bare pickle's, the minimal stateful channel (with
    ``minimal``) 0.9 of vLLM's serializer's."""
    return {"steps": steps, "bytes": nbytes, "vllm_bytes": vbytes, "us": us * steps,
            "vllm_us": vus * steps, "bare_us": bus * steps, "median_us": us,
            "median_vllm_us": vus, "median_bare_us": bus, "floor_us": bus / 4 * steps,
            "median_floor_us": bus / 4} | ({"minimal_us": 0.9 * vus * steps,
                                            "median_minimal_us": 0.9 * vus,
                                            "minimal_bytes": 2 * nbytes,
                                            "digested_us": 1.2 * vus * steps,
                                            "median_digested_us": 1.2 * vus} if minimal else {})


def _stream(us: float = 10.0, join_us: float = 10.0, vus: float = 20.0, nbytes: int = 100,
            vbytes: int = 2000, join: int = 2, steps: int = 10) -> dict[str, Any]:
    """A replay summary: ``steps`` steps of which ``join`` join or leave; ours ``us`` per
    step (``join_us`` at join/leave steps), vLLM's ``vus``, bare pickle's half of it."""
    same = steps - join
    return {"steps": steps, "max_running": 8, "median_running": 6, "passes": 1,
            "request": _path(steps, nbytes, vbytes, us, vus, vus / 2),
            "reply": _path(steps, nbytes // 2, vbytes, us, vus, vus / 2, minimal=False),
            "join_leave": _path(join, 0, 0, join_us, vus, vus / 2),
            "same_batch": _path(same, 0, 0, us, vus, vus / 2),
            "request_fields": {"header": 40 * steps, "added.prompt": 60 * steps}}


def _doc() -> dict[str, Any]:
    workloads = {"decode": _stream(), "online64": _stream(us=25.0, join_us=35.0),
                 "prefix": _stream(join_us=29.0, vbytes=1000)}
    return {"meta": {"date": "today", "commit": "abc", "load": 1.0, "passes": 1,
                     "kernels": True, "vllm": "0.32.0"},
            "workloads": workloads,
            "synthetic": {"256": _stream(join=1), "churn-16": _stream(us=30.0, join=10,
                                                                       join_us=30.0)},
            "total": vllm_streams.totals(workloads)}


def test_targets_judge_each_limit_against_vllm_and_report_bare_pickle() -> None:
    got = {t["target"]: t for t in targets(_doc())}
    median = {k: v["met"] for k, v in got.items() if k.endswith(": median µs ÷ vLLM")}
    assert median == {"decode: median µs ÷ vLLM": True, "online64: median µs ÷ vLLM": False,
                      "prefix: median µs ÷ vLLM": True, "synthetic-256: median µs ÷ vLLM": True,
                      "synthetic-churn-16: median µs ÷ vLLM": False}  # 25 and 30 µs > 20
    join = got["online64: join/leave steps' median µs ÷ vLLM (2 steps)"]
    assert join["value"] == 1.75 and join["bare"] == 3.5 and join["met"] is False
    assert got["prefix: join/leave steps' median µs ÷ vLLM (2 steps)"]["met"] is True  # 1.45
    assert not [k for k in got if k.startswith("synthetic") and "join/leave" in k]
    summed = got["all recorded: summed µs ÷ vLLM"]  # (100 + 250 + 100) / 600
    assert summed["value"] == pytest.approx(0.75) and summed["met"] is False
    assert summed["limit"] == "≤ 0.7"
    fewer = got["all recorded: × fewer request bytes"]  # 5000 / 300
    assert fewer["value"] == pytest.approx(16.667) and fewer["met"] is True
    fields = page_tables.from_streams(_doc())  # same-batch steps: the table's column
    row = next(r for r in fields["rows"] if r[0] == "online64")
    assert row[fields["columns"].index("same-batch median ÷ vLLM")] == 1.25
    # the minimal stateful channel's figure beside every timed target (0.9 of vLLM's everywhere)
    assert {t["minimal"] for k, t in got.items() if "bytes" not in k} == {0.9}
    assert {t["digested"] for k, t in got.items() if "bytes" not in k} == {1.2}
    assert fewer["minimal"] is None and fewer["digested"] is None
    doc = _doc()  # a faster run meets the summed target
    for w in doc["workloads"].values():
        w["request"]["us"] = 5.0 * w["steps"]
    doc["total"] = vllm_streams.totals(doc["workloads"])
    assert {t["target"]: t["met"] for t in targets(doc)}["all recorded: summed µs ÷ vLLM"]


def test_render_has_one_row_per_stream_and_the_totals() -> None:
    text = render(_doc())
    for name in ("decode", "online64", "prefix", "synthetic-256", "synthetic-churn-16"):
        # the request, step-kind, reply, floor and request-field tables
        assert text.count(f"| {name} |") == 5, name
    assert text.count("| **all recorded** |") == 3  # the request, reply and floor tables
    # the floor: a quarter of bare pickle's step (ours 10 µs against its 2.5)
    assert "| decode | 2.5 | 0.25 | 0.25 | 4.00 |" in text
    assert "| synthetic-churn-16 | 10 | 30.0 | 1.50 | 3.00 | 0 | – | – | – |" in kinds(_doc())
    assert "**16.7×**" in text and "**not met**" in text
    assert "header 40%" in text and "added.prompt 60%" in text
    assert "C kernels" in text and "Exactness" not in text
    old = _doc()  # a document from before the floor was measured renders without it
    for w in [*old["workloads"].values(), *old["synthetic"].values()]:
        for part in ("request", "reply", "join_leave", "same_batch"):
            del w[part]["floor_us"], w[part]["median_floor_us"]
    old["total"] = {path: {k: v for k, v in t.items() if k != "floor_us"}
                    for path, t in old["total"].items()}
    assert "Python floor" not in render(old) and "Python floor" in text
    # the minimal channel beside each target: 0.9; without its figures, "–"
    assert "| online64: join/leave steps' median µs ÷ vLLM (2 steps) | 1.75 | 3.5 | 0.9 | 1.2 |" \
        in text
    for w in [*old["workloads"].values(), *old["synthetic"].values()]:
        for part in ("request", "join_leave", "same_batch"):
            for key in ("minimal_us", "median_minimal_us", "minimal_bytes", "digested_us",
                        "median_digested_us"):
                del w[part][key]
    old["total"] = vllm_streams.totals(old["workloads"])
    assert "minimal_us" not in old["total"]["request"]
    assert "| online64: join/leave steps' median µs ÷ vLLM (2 steps) | 1.75 | 3.5 | – | – |" \
        in render(old)


def test_the_page_converter_reads_the_document() -> None:
    doc = _doc()
    fields = page_tables.from_streams(doc)
    env = {**fields, "command": ".venv/bin/python -m engine_side.bench.vllm_streams "
                                "--figures f.json",
           "machine": dict.fromkeys(figures.MACHINE_KEYS, "?"),
           "date": "2026-01-01 00:00 UTC", "commit": "abcdef0"}
    assert figures.envelope_problems(env) == []
    rows = {r[0]: r for r in env["rows"]}
    assert list(rows) == ["decode", "online64", "prefix", "synthetic-256",
                          "synthetic-churn-16", "all recorded"]
    assert rows["online64"][-1] == "median, summed, join/leave, same-batch"
    assert rows["decode"][-1] == page_tables.NONE
    assert rows["all recorded"][4] == pytest.approx(16.7)
    floor = env["columns"].index("floor ÷ bare")  # a quarter of bare pickle's step
    assert rows["decode"][floor] == rows["all recorded"][floor] == pytest.approx(0.25)
    minimal = env["columns"].index("minimal ÷ vLLM")  # 0.9 of vLLM's serializer's step
    assert rows["decode"][minimal] == rows["all recorded"][minimal] == pytest.approx(0.9)
    digested = env["columns"].index("+ digest ÷ vLLM")
    assert rows["decode"][digested] == rows["all recorded"][digested] == pytest.approx(1.2)
    named = {t["target"]: t for t in env["targets"]}
    assert "online64: median µs ÷ vLLM (bare: 2.5; minimal: 0.9; + digest: 1.2)" in named
    assert "all recorded: × fewer request bytes" in named  # no bracket without figures
    assert env["raw"] is doc


def test_recordings_are_reused_unless_fresh(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams already in the cache are kept (no model is built); --fresh records all."""
    from engine_side.bench import vllm_online, vllm_scenarios

    calls: list[tuple[str, Any]] = []

    def build(path: Path) -> Path:
        calls.append(("model", path))
        return path

    def record_many(model: Path, names: Any, out: Path, force: bool = False) -> dict[str, Any]:
        calls.append(("record", (list(names), out, force)))
        return {}

    monkeypatch.setattr(vllm_scenarios, "build_tiny_model", build)
    monkeypatch.setattr(vllm_online, "record_many", record_many)
    (tmp_path / "main.dcobj").write_bytes(b"")
    paths = vllm_streams.record(tmp_path, ["main"])
    assert paths == {"main": tmp_path / "main.dcobj"}
    assert calls == [("record", (["main"], tmp_path, False))]
    calls.clear()
    vllm_streams.record(tmp_path, ["main", "spec"])  # one missing: the model is needed
    assert calls[0] == ("model", tmp_path / "tiny-llama")
    calls.clear()
    vllm_streams.record(tmp_path, ["main"], fresh=True, model=tmp_path / "m")
    assert calls == [("model", tmp_path / "m"), ("record", (["main"], tmp_path, True))]


def test_unknown_scenarios_are_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert vllm_streams.main(["--only", "main,nope", "--cache", str(tmp_path)]) == 2
    assert "unknown scenario(s) nope" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.fixture()
def small_synthetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command's synthetic streams, small: decode and churn at 8 requests, 6 steps."""
    monkeypatch.setattr(vllm_streams, "SYNTHETIC", (8,))
    monkeypatch.setattr(vllm_streams, "CHURN", (8,))
    monkeypatch.setattr(vllm_streams, "SYNTHETIC_STEPS", 6)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.usefixtures("small_synthetic")
def test_replay_of_golden_streams_is_exact_and_adds_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, envelope = tmp_path / "doc.json", tmp_path / "figures.json"
    argv = ["--replay", *(str(GOLDEN / f"{n}.dcobj") for n in RECORDED), "--passes", "1",
            "--check", "--json", str(out), "--figures", str(envelope)]
    assert vllm_streams.main(argv) == 0
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert list(doc["workloads"]) == list(RECORDED)
    assert list(doc["synthetic"]) == ["8", "churn-8"]
    assert doc["meta"]["passes"] == 1 and doc["meta"]["check"] is True
    for name, w in doc["workloads"].items():
        stats = w["stream"]["stats"]
        assert w["steps"] == stats["steps"] and w["max_running"] == stats["batch_max"]
        assert w["check"]["differences"] == 0 and w["check"]["first"] == []
        assert w["check"]["records"] == stats["records"]
        # exact accounting: every request byte in one wire field
        assert sum(w["request_fields"].values()) == w["request"]["bytes"] > 0
        assert 0 < w["request"]["bytes"] < w["request"]["vllm_bytes"]
        assert w["join_leave"]["steps"] + w["same_batch"]["steps"] == w["steps"]
        assert w["join_leave"]["steps"] == stats["churn_steps"] > 0, name
        assert w["reply"]["steps"] == w["steps"]
        assert all(w["request"][k] > 0 for k in ("us", "vllm_us", "bare_us", "floor_us",
                                                   "minimal_us", "minimal_bytes",
                                                   "digested_us"))
        assert w["reply"]["floor_us"] == 0  # the floor builds SchedulerOutputs only
    total = doc["total"]["request"]
    assert total["bytes"] == sum(w["request"]["bytes"] for w in doc["workloads"].values())
    churn = doc["synthetic"]["churn-8"]
    assert churn["steps"] == churn["join_leave"]["steps"] == 6  # every step
    assert doc["synthetic"]["8"]["join_leave"]["steps"] == 1  # all of them join at once
    assert printed == render(doc) + "\n"
    for name in (*RECORDED, "synthetic-8", "synthetic-churn-8"):
        assert f"| {name} |" in printed
    env = json.loads(envelope.read_text())
    assert figures.envelope_problems(env) == [] and env["raw"] == doc
    assert vllm_streams.main(["--render", str(out)]) == 0
    assert capsys.readouterr().out == printed


@pytest.mark.vllm
@needs_vllm
@pytest.mark.usefixtures("small_synthetic")
def test_check_reports_a_decoder_that_gets_a_step_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoded step that differs from the original is reported, the exit status is 1
    and no figures are written."""
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    real = SchedulerOutputDecoder.decode

    def wrong(self: SchedulerOutputDecoder, frames: list[Any]) -> Any:
        so = real(self, frames)
        if self.seq == 3:
            so.total_num_scheduled_tokens += 1
        return so

    monkeypatch.setattr(SchedulerOutputDecoder, "decode", wrong)
    _, messages = vllm_streams.load(GOLDEN / "main.dcobj")
    got = vllm_streams.check_stream(messages)
    assert got["differences"] == 1 and got["records"] == len(messages)
    assert got["first"][0].startswith("record ") and "total_num_scheduled_tokens" in got["first"][0]
    envelope = tmp_path / "figures.json"
    argv = ["--replay", str(GOLDEN / "spec.dcobj"), "--passes", "1", "--check",
            "--figures", str(envelope)]
    assert vllm_streams.main(argv) == 1
    assert not envelope.exists()


@pytest.mark.vllm
@needs_vllm
def test_churn_stream_round_trips_and_every_step_is_join_leave() -> None:
    """The continuous-batching stream: one request leaves and one joins each step."""
    from engine_side.bench.vllm_replay import joins_or_leaves, synthetic_churn

    stream = synthetic_churn(8, 6, prompt=64)
    steps = [obj for kind, obj in stream if kind == "execute_model"]
    assert vllm_streams.check_stream(stream)["differences"] == 0
    assert all(len(so.num_scheduled_tokens) == 8 for so in steps)
    assert [len(so.finished_req_ids) for so in steps] == [0] + [1] * 5
    assert all(joins_or_leaves(so) for so in steps)
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
    assert {"main", "spec", "online64"} <= set(vllm_streams.scenario_names())


@pytest.mark.vllm
@needs_vllm
def test_replay_passes_take_each_steps_median(monkeypatch: pytest.MonkeyPatch) -> None:
    """With passes, each step's µs on every path is the median of its passes (the passes
    here report known figures); bytes are one pass's, each pass starts the rotation of
    the six paths one further on, and a pass count below one is refused."""
    from engine_side.bench import vllm_replay
    from engine_side.bench.vllm_replay import replay, synthetic_decode

    messages = synthetic_decode(4, 8, prompt=64)
    real = vllm_replay._one_pass
    rotations: list[int] = []

    def scripted(msgs: Any, rotate: int, fields: Any) -> Any:
        steps, carried = real(msgs, rotate, fields)
        k = len(rotations)
        rotations.append(rotate)
        for i, step in enumerate(steps):  # pass k: µs (10k + i, ..., 1000000k + i)
            for acc in step.figures.values():
                acc[2:7] = [(10.0 ** e * k + i) / 1e6 for e in range(1, 6)]
                acc[8] = (1e6 * k + i) / 1e6
        return steps, carried

    monkeypatch.setattr(vllm_replay, "_one_pass", scripted)
    one = replay(messages)
    three = replay(messages, passes=3)
    assert rotations == [0, 0, 1, 2]
    assert three["passes"] == 3 and three["steps"] == one["steps"] == 8
    assert three["request"]["bytes"] == one["request"]["bytes"]
    # step i of the three passes (k = 1, 2, 3) reads 10k + i: its median is 20 + i
    assert three["request"]["us"] == pytest.approx(sum(20.0 + i for i in range(8)))
    assert three["request"]["vllm_us"] == pytest.approx(sum(200.0 + i for i in range(8)))
    assert three["request"]["bare_us"] == pytest.approx(sum(2000.0 + i for i in range(8)))
    assert three["request"]["floor_us"] == pytest.approx(sum(20000.0 + i for i in range(8)))
    assert three["request"]["minimal_us"] == pytest.approx(sum(200000.0 + i for i in range(8)))
    assert three["request"]["digested_us"] == pytest.approx(sum(2e6 + i for i in range(8)))
    assert "minimal_us" not in three["reply"]  # the minimal channel carries execute_model only
    assert three["request"]["median_us"] == pytest.approx(20.0 + 3.5)
    with pytest.raises(ValueError, match="passes"):
        replay(messages, passes=0)


@pytest.mark.vllm
@needs_vllm
def test_replay_times_every_message_on_all_six_paths(monkeypatch: pytest.MonkeyPatch,
                                                      ) -> None:
    from engine_side.bench import vllm_replay
    from engine_side.bench.vllm_replay import replay, synthetic_decode

    messages = synthetic_decode(4, 6, prompt=64)
    log: list[str] = []
    real_pickled, real_ours = vllm_replay.pickled, vllm_replay._ours

    def pickled(kind: str, obj: Any, bare: bool = False) -> Any:
        log.append("bare" if bare else "vllm")
        return real_pickled(kind, obj, bare)

    def ours(route: Any, obj: Any) -> Any:
        log.append("ours")
        return real_ours(route, obj)

    def floor(kind: str, obj: Any) -> float:
        log.append("floor")
        return real_floor(kind, obj)

    def minimal(kind: str, obj: Any, pair: Any) -> Any:
        log.append("digested" if pair[0].digest else "minimal")
        return real_minimal(kind, obj, pair)

    real_floor, real_minimal = vllm_replay.python_floor, vllm_replay.minimal_step
    monkeypatch.setattr(vllm_replay, "pickled", pickled)
    monkeypatch.setattr(vllm_replay, "_ours", ours)
    monkeypatch.setattr(vllm_replay, "python_floor", floor)
    monkeypatch.setattr(vllm_replay, "minimal_step", minimal)
    replay(messages)
    assert len(log) == 6 * len(messages)
    for i in range(len(messages)):
        assert sorted(log[6 * i:6 * i + 6]) == ["bare", "digested", "floor", "minimal", "ours",
                                                "vllm"]
    assert len({tuple(log[6 * i:6 * i + 6]) for i in range(6)}) == 6  # the order rotates


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("name", RECORDED)
def test_the_floor_builds_each_step_again_in_fresh_containers(name: str) -> None:
    """The floor is a fair one: the object it builds equals the recorded step exactly,
    and shares none of its lists, dicts or sets (a rank's runner keeps and edits them)."""
    from vllm_equal import differences

    from engine_side.bench.vllm_replay import load_stream, rebuilt_in_python

    steps = [o for k, o in load_stream(GOLDEN / f"{name}.dcobj") if k == "execute_model"]
    assert steps
    for so in steps:
        got = rebuilt_in_python(so)
        assert differences(so, got) == []
        c, d = so.scheduled_cached_reqs, got.scheduled_cached_reqs
        pairs = [(so.num_scheduled_tokens, got.num_scheduled_tokens),
                 (so.finished_req_ids, got.finished_req_ids), (c.req_ids, d.req_ids),
                 (c.num_computed_tokens, d.num_computed_tokens),
                 *((a, b) for x, y in zip(c.new_block_ids, d.new_block_ids, strict=True)
                   if x is not None for a, b in zip(x, y, strict=True)),
                 *((a, b) for x, y in zip(so.scheduled_new_reqs, got.scheduled_new_reqs,
                                          strict=True) for a, b in zip(x.block_ids,
                                                                       y.block_ids,
                                                                       strict=True))]
        assert not any(a is b for a, b in pairs)


@pytest.mark.vllm
@needs_vllm
def test_the_pickle_baseline_runs_vllms_own_serializer() -> None:
    """``vllm_serialize`` / ``vllm_deserialize`` run the lines vLLM's MessageQueue runs:
    each is in vLLM's own source (a vLLM that changes them fails here).  Buffers under
    1 MiB stay in band and larger ones go out of band, both load back equal; without
    buffers the bytes are bare pickle's."""
    import inspect

    import numpy as np
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue
    from vllm_equal import differences

    from engine_side.bench import vllm_replay
    from engine_side.bench.vllm_replay import load_stream, pickled

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
    so = next(obj for kind, obj in load_stream(GOLDEN / "main.dcobj") if kind == "execute_model")
    assert not differences(vllm_replay.vllm_deserialize(vllm_replay.vllm_serialize(so)), so)
    assert pickled("execute_model", so)[0] == pickled("execute_model", so, bare=True)[0]
