"""The two-host step-latency benchmark (engine_side/bench/vllm_link.py) at a tiny size: every
step the remote rank held is the one sent (ours: the decoded SchedulerOutput, field by
field; vLLM's: the dequeued RPC tuple), and every run has positive latencies.  Skipped
cleanly without vLLM or network namespaces; no wall-clock assertions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

from engine_side.bench import netns, vllm_link  # noqa: E402
from engine_side.bench.figures import envelope_problems  # noqa: E402
from engine_side.bench.page_link import from_link  # noqa: E402
from engine_side.bench.vllm_streams import stream_files  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
RUNNING, STEPS = 16, 20
RECORDED = "recorded-churn"  # an object stream replayed with --streams


def _recording(directory: Path) -> Path:
    """An object stream as vllm_streams records one: execute_model, then sample_tokens
    (no grammar), every step."""
    from engine_side.bench.objstream import write_stream

    records: list[tuple[str, Any]] = []
    for kind, obj in vllm_link.stream("churn", RUNNING, STEPS // 2):
        records += [(kind, obj), ("sample_tokens", None)]
    path = directory / f"{RECORDED}.dcobj"
    write_stream(path, records, {"scenario": RECORDED})
    return path


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    streams = (str(_recording(tmp_path_factory.mktemp("link"))),)
    return vllm_link.run([RUNNING], STEPS, rounds=1, check=True, streams=streams)


def test_the_check_can_fail() -> None:
    """The comparison the receiver runs finds a step that is not the one sent."""
    msgs = vllm_link.stream("churn", RUNNING, 3)
    (kind, first), (_, second) = msgs[1], msgs[2]
    assert vllm_link.compare("ours", kind, first, first) == []
    assert vllm_link.compare("ours", kind, first, second)
    from engine_side.bench.vllm_replay import vllm_message

    assert vllm_link.compare("vllm", kind, first, vllm_message(kind, first)) == []
    assert vllm_link.compare("vllm", kind, first, vllm_message(kind, second))
    assert vllm_link.compare("vllm", kind, first, first)  # the bare object is not the tuple


def test_every_step_held_is_the_one_sent(doc: dict[str, Any]) -> None:
    runs = doc["runs"]
    assert {(r["path"], r["workload"]) for r in runs} == {
        (p, w) for p in vllm_link.PATHS for w in (*vllm_link.WORKLOADS, RECORDED)}
    for r in runs:
        assert r["checked"], r["path"]
        assert r["differences"] == 0, (r["path"], r["workload"], r["first"])
        steps = STEPS // 2 if r["workload"] == RECORDED else STEPS  # (sample_tokens untimed)
        assert len(r["latency_us"]) == r["steps"] == steps
    assert doc["differences"] == 0


def test_each_row_has_positive_latencies(doc: dict[str, Any]) -> None:
    for r in doc["runs"]:
        assert all(x > 0 for x in r["latency_us"]), (r["path"], r["workload"])
        assert r["median_us"] > 0 and r["p99_us"] >= r["median_us"]
        assert r["tx_bytes"] > 0
    for w in doc["summary"]:
        assert w["running"] == RUNNING
        for path in vllm_link.PATHS:
            assert w[f"{path}_median_us"] > 0 and w[f"{path}_p99_us"] > 0
            assert w[f"{path}_bytes_per_step"] > 0


def test_the_figures_table(doc: dict[str, Any]) -> None:
    fields = from_link(doc)
    assert len(fields["rows"]) == len(vllm_link.WORKLOADS) + 1
    assert all(len(r) == len(fields["columns"]) for r in fields["rows"])
    env = {**fields, "command": ".venv/bin/python -m engine_side.bench.vllm_link --figures f",
           "machine": dict.fromkeys(("cpu", "cores", "python", "torch", "vllm"), "?"),
           "date": "2026-01-01 00:00 UTC", "commit": "abcdef0"}
    assert envelope_problems(env) == []


def test_streams_name_a_recording_or_a_scenario(tmp_path: Path) -> None:
    """``--streams`` takes object stream files and scenario names; anything else is a
    clear error, before any namespace is made."""
    path = _recording(tmp_path)
    assert stream_files([str(path)]) == (str(path),)
    with pytest.raises(ValueError, match="no such object stream"):
        stream_files([str(tmp_path / "missing.dcobj")])
    with pytest.raises(ValueError, match="neither an object stream"):
        stream_files(["online9999"])
    assert vllm_link.main(["--streams", "online9999"]) == 2
