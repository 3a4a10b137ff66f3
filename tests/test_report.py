"""deltacast report: accounting that adds up, honest baselines, and a working CLI."""

from __future__ import annotations

import argparse
import itertools
import json
import pickle
import struct
from pathlib import Path

import msgspec
import pytest

from engine_side.bench import baselines
from engine_side.mirror import EngineMirror
from engine_side.report import cli
from engine_side.report.accounting import CATEGORIES, delta_breakdown, pickle_v1_breakdown
from engine_side.report.replay import FORMATS, replay
from engine_side.report.workloads import BUILTIN, load_workload
from protocol import codec
from protocol.recording import MAGIC_V1, RecordHeader
from protocol.request import request_differences


@pytest.mark.parametrize("name", list(BUILTIN))
def test_deltacast_fields_sum_to_the_message_size(name: str) -> None:
    source = load_workload(name, steps=15, batch=12, seed=3, quick=True)
    mirror = EngineMirror(token_mode=source.token_mode)
    seen = dict.fromkeys(CATEGORIES, 0)
    for req in itertools.islice(source.requests, source.steps):
        delta = mirror.diff(req)
        frames = codec.encode(delta)
        split = delta_breakdown(delta, frames)
        assert set(split) == set(CATEGORIES)
        assert all(v >= 0 for v in split.values()), split
        assert sum(split.values()) == codec.encoded_size(frames)
        for k, v in split.items():
            seen[k] += v
    assert seen["header"] > 0 and seen["new requests"] > 0 and seen["prompt tokens"] > 0


def test_multimodal_tensors_are_counted_as_frames() -> None:
    source = load_workload("multimodal", steps=2, batch=4, seed=0, quick=True)
    delta = EngineMirror(token_mode=source.token_mode).diff(next(source.requests))
    frames = codec.encode(delta)
    assert delta_breakdown(delta, frames)["tensor frames"] == 4 * 3 * 112 * 112 * 4


def test_baseline_sizes_are_what_the_serializers_produce() -> None:
    source = load_workload("mixed_chat", steps=6, batch=8, seed=1, quick=True)
    requests = list(itertools.islice(source.requests, 6))
    result = replay("mixed_chat", requests, 8, source.token_mode)
    v1 = baselines.V1Scheduler()
    for i, req in enumerate(requests):
        so = v1.convert(req)
        v1_size = len(pickle.dumps(baselines.rpc_message(so), protocol=5))
        assert result.steps["pickle_v1"][i].bytes == v1_size
        # protocol 5 with out-of-band buffers, as vLLM's MessageQueue sends it
        oob = baselines.pickle_frames(req)
        assert result.steps["pickle"][i].bytes == baselines.frames_size(oob)
        assert len(oob) > 1 and baselines.frames_size(oob) > len(pickle.dumps(req.req_ids))
        split = pickle_v1_breakdown(so, v1_size)
        assert sum(split.values()) == v1_size
    assert set(result.steps) == set(FORMATS)


def test_report_cli_writes_markdown_json_and_plots(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["decode_heavy", "multimodal", "--quick", "--out", str(tmp_path)])
    assert cli.run(args) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [w["workload"] for w in report["workloads"]] == ["decode_heavy", "multimodal"]
    for name in report["figures"].values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "report.md").read_text()
    assert "| decode_heavy |" in text and "bytes_per_step.png" in text


def test_report_refuses_unknown_workloads_and_foreign_files(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert cli.run(parser.parse_args(["nope", "--quick", "--out", str(tmp_path)])) == 2
    foreign = tmp_path / "stream.pkl"
    foreign.write_bytes(pickle.dumps({"not": "a recording"}))
    assert cli.run(parser.parse_args([str(foreign), "--quick", "--out", str(tmp_path)])) == 2
    old = tmp_path / "old.dcrec"  # a protocol-1 recording: its header names no major
    header = msgspec.msgpack.encode(RecordHeader(protocol=1))
    old.write_bytes(MAGIC_V1 + struct.pack("<I", len(header)) + header)
    assert cli.run(parser.parse_args([str(old), "--quick", "--out", str(tmp_path)])) == 2


def test_report_replays_a_recording(tmp_path: Path) -> None:
    """A `deltacast record` file (typed Delta frames) is replayed like a workload."""
    from protocol.recording import RecordWriter

    source = load_workload("mixed_chat", steps=10, batch=8, seed=2, quick=True)
    mirror = EngineMirror(token_mode=source.token_mode)
    path = tmp_path / "run.dcrec"
    originals = list(itertools.islice(source.requests, 10))
    with RecordWriter(path, meta={"model": "synthetic"}) as writer:
        for req in originals:
            writer.write("execute_model", codec.encode(mirror.diff(req)))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    out = tmp_path / "out"
    assert cli.run(parser.parse_args([str(path), "--quick", "--no-sweep", "--out", str(out)])) == 0
    report = json.loads((out / "report.json").read_text())
    (workload,) = report["workloads"]
    assert workload["workload"] == "run" and workload["formats"]["deltacast"]["steps"] == 10
    replayed = load_workload(str(path), steps=10, batch=None, seed=0)
    for got, want in zip(replayed.requests, originals, strict=True):
        assert request_differences(got, want) == []
