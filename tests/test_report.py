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
from engine_side.report.accounting import (
    CATEGORIES,
    body_field_sizes,
    delta_breakdown,
    message_fields,
    pickle_v1_breakdown,
)
from engine_side.report.replay import FORMATS, replay
from engine_side.report.workloads import BUILTIN, load_workload
from engine_side.request_diff import RequestDiffer
from protocol import codec
from protocol.cli_support import EXIT_NO_INPUT, CliError
from protocol.ext import StepExt, encode_ext
from protocol.messages import Delta, DeltaBody, NewRequest, RareBody, Spec, encode_spec
from protocol.recording import MAGIC_V1, RecordHeader
from protocol.request import request_differences


@pytest.mark.parametrize("name", list(BUILTIN))
def test_deltacast_fields_sum_to_the_message_size(name: str) -> None:
    source = load_workload(name, steps=15, batch=12, seed=3, quick=True)
    differ = RequestDiffer(EngineMirror(token_mode=source.token_mode))
    seen = dict.fromkeys(CATEGORIES, 0)
    for req in itertools.islice(source.requests, source.steps):
        delta = differ.diff(req)
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
    delta = RequestDiffer(EngineMirror(token_mode=source.token_mode)).diff(next(source.requests))
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

    def refused(*argv: str) -> str:
        with pytest.raises(CliError) as info:
            cli.run(parser.parse_args([*argv, "--quick", "--out", str(tmp_path / "out")]))
        assert info.value.code == EXIT_NO_INPUT
        return str(info.value)

    assert "no such file" in refused("nope")
    foreign = tmp_path / "stream.pkl"
    foreign.write_bytes(pickle.dumps({"not": "a recording"}))
    refused(str(foreign))
    old = tmp_path / "old.dcrec"  # a protocol-1 recording: its header names no major
    header = msgspec.msgpack.encode(RecordHeader(protocol=1))
    old.write_bytes(MAGIC_V1 + struct.pack("<I", len(header)) + header)
    refused(str(old))


def test_report_replays_a_recording(tmp_path: Path) -> None:
    """A `deltacast record` file (typed Delta frames) is replayed like a workload."""
    from protocol.recording import RecordWriter

    source = load_workload("mixed_chat", steps=10, batch=8, seed=2, quick=True)
    differ = RequestDiffer(EngineMirror(token_mode=source.token_mode))
    path = tmp_path / "run.dcrec"
    originals = list(itertools.islice(source.requests, 10))
    with RecordWriter(path, meta={"model": "synthetic"}) as writer:
        for req in originals:
            writer.write("execute_model", codec.encode(differ.diff(req)))
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


def _known_delta() -> tuple[Delta, list[bytes]]:
    """A Delta whose every entry is known: one added request (a 20-byte id, 64 prompt
    tokens), a finished handle, rare entries and an adapter extension."""
    spec = Spec(req_id="r" * 20, prompt=bytes(range(64)))
    body = DeltaBody(finished=b"\x01\x00", added=(NewRequest(3, encode_spec(spec), 5),),
                     rare=RareBody(finished_unknown=("gone",), num_spec_tokens_to_schedule=2),
                     extension=encode_ext(StepExt(kv_groups=1, out_pos=b"\x02\x07")))
    delta = Delta(1, 7, 12345, body)
    return delta, [bytes(f) for f in codec.encode(delta)]


def test_breakdown_splits_known_entries_exactly() -> None:
    """Each category is the bytes of its entries as msgpack writes them (key + value),
    the spec's id and prompt split out of the new request; the rest is header."""
    delta, frames = _known_delta()
    split = delta_breakdown(delta, frames)
    assert sum(split.values()) == codec.encoded_size(frames)
    assert split["prompt tokens"] == 2 + 2 + 64  # "p", bin8 header + length, the bytes
    assert split["ids"] == 2 + 21 + 3 + 6  # "i" + the id; "fx" + ["gone"]
    assert split["schedule changes"] == 2 + 4 + 3 + 1  # "f" + bin(2); "ns" + 2
    assert split["extension slot"] == body_field_sizes(delta.body)["x"]
    assert split["tensor frames"] == 0 and split["blocks"] == split["tokens"] == 0


def test_message_fields_name_every_wire_field_and_add_up() -> None:
    delta, frames = _known_delta()
    fields = message_fields("execute_model", frames)
    assert sum(fields.values()) == codec.encoded_size(frames)
    assert set(fields) == {"header", "finished", "added", "added.req_id", "added.prompt",
                           "rare.finished_unknown", "rare.num_spec_tokens_to_schedule",
                           "ext.kv_groups", "ext.out_pos"}
    assert fields["added.prompt"] == 68 and fields["added.req_id"] == 23
    assert fields["ext.out_pos"] == 3 + 4  # "op" + bin(2)
    assert fields["ext.kv_groups"] == 3 + 1
    assert fields["finished"] == 2 + 4
    assert message_fields("sample_tokens", [b"abc", b"de"]) == {"grammar": 5}
    with pytest.raises(ValueError, match="kind"):
        message_fields("reply", frames)
