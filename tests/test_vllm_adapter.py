"""vLLM adapter: exact SchedulerOutput / GrammarOutput / ModelRunnerOutput round-trips.

Every round-trip is checked with THE strict helper ``tests/vllm_equal.py``.
Skipped cleanly when vLLM is not installed.
"""

from __future__ import annotations

import copy
import pickle
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed")

from hypothesis import event, given, settings  # noqa: E402
from vllm.v1.core.sched.output import GrammarOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, LogprobsLists, ModelRunnerOutput  # noqa: E402
from vllm_equal import assert_vllm_equal  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.vllm import BadSeal, SchedulerOutputEncoder, SchemaMismatch  # noqa: E402
from engine_side.vllm.schema import check_schema, vllm_classes  # noqa: E402
from protocol.bitmask import DEFLATE_MAX, GrammarMsg, sparse_words  # noqa: E402
from protocol.errors import MalformedMessage, RemoteProtocolError  # noqa: E402
from protocol.ext import ReplyMsg  # noqa: E402
from protocol.packing import pack_uints  # noqa: E402
from worker_side.vllm import SchedulerOutputDecoder  # noqa: E402

pytestmark = pytest.mark.vllm
SECRET = b"k" * 32


def _wire(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


def _pair(kv_groups: int | None = None,
          ) -> tuple[SchedulerOutputEncoder, SchedulerOutputDecoder]:
    return (SchedulerOutputEncoder(kv_groups, secret=SECRET),
            SchedulerOutputDecoder(secret=SECRET))


@settings(max_examples=40)
@given(stream=scheduler_streams())
def test_generated_streams_round_trip_exactly(stream: dict[str, Any]) -> None:
    enc, dec = _pair(kv_groups=stream["kv_groups"])
    for so in stream["steps"]:
        expected = copy.deepcopy(so)
        frames = _wire(enc.encode(so))
        so.scheduled_spec_decode_tokens.clear()  # the engine mutates after dispatch
        got = dec.decode(frames)
        assert_vllm_equal(expected, got)
        for shape in _shapes(expected):
            event(shape)
        for nr in got.scheduled_new_reqs:  # the runner keeps and extends these lists
            for ids in nr.block_ids:
                ids.append(-5)


@settings(max_examples=15)
@given(stream=scheduler_streams(v2=True))
def test_v2_streams_and_their_replies_round_trip(stream: dict[str, Any]) -> None:
    """Model Runner V2's shape: resumed requests arrive as new ones whose
    ``prefill_token_ids`` (the history) travel as a reference to their prompt."""
    enc, dec = _pair(kv_groups=stream["kv_groups"])
    for so in stream["steps"]:
        got = dec.decode(_wire(enc.encode(so)))
        assert_vllm_equal(so, got)
        reply = _reply(list(so.num_scheduled_tokens), so)
        assert_vllm_equal(reply, enc.decode_reply(_wire(dec.encode_reply(reply))))


def _shapes(so: Any) -> list[str]:
    """Stream shapes a step shows (reported as Hypothesis events)."""
    c = so.scheduled_cached_reqs
    shapes = {
        "v1_resumed": bool(c.resumed_req_ids), "all_token_ids": bool(c.all_token_ids),
        "pp_new_token_ids": bool(c.new_token_ids), "preempted": bool(so.preempted_req_ids),
        "v2_resumed_as_new": any(len(nr.prefill_token_ids or ()) > len(nr.prompt_token_ids or ())
                                 for nr in so.scheduled_new_reqs),
        "draft_placeholders": any(-1 in t for t in so.scheduled_spec_decode_tokens.values()),
        "finished_and_readded": bool(so.finished_req_ids & set(so.num_scheduled_tokens)),
        "connector_metadata": so.kv_connector_metadata is not None}
    return [name for name, seen in shapes.items() if seen]


def _reply(ids: list[str], so: Any) -> ModelRunnerOutput:
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[len(r) % 7] for r in ids])


def _first(enc: SchedulerOutputEncoder, dec: SchedulerOutputDecoder) -> Any:
    """One hand-made first step (three new requests) through the pair."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    ids = ["a-1", "b-2", "c-3"]
    new = [NewRequestData(rid, [1, 2, 3, k], [], SamplingParams(temperature=0), None,
                          ([k + 1],), 0, None) for k, rid in enumerate(ids)]
    so = SchedulerOutput(new, CachedRequestData.make_empty(), dict.fromkeys(ids, 4), 12, {}, {},
                         set(), [], preempted_req_ids=set())
    assert_vllm_equal(so, dec.decode(_wire(enc.encode(so))))
    return so


def test_grammar_output_round_trips() -> None:
    enc, dec = _pair()
    so = _first(enc, dec)
    ids = list(so.num_scheduled_tokens)[::-1] + ["not-in-batch"]
    mask = np.arange(len(ids) * 4, dtype=np.int32).reshape(len(ids), 4)
    grammar = GrammarOutput(ids, mask, [1] * len(ids))
    assert_vllm_equal(grammar, dec.decode_grammar(_wire(enc.encode_grammar(grammar))))
    assert dec.decode_grammar(_wire(enc.encode_grammar(None))) is None


def test_sparse_grammar_bitmask_is_deflated_and_exact() -> None:
    enc, dec = _pair()
    so = _first(enc, dec)
    ids = list(so.num_scheduled_tokens)
    mask = np.zeros((len(ids), 512), dtype=np.int32)  # mostly-zero rows, as xgrammar's
    mask[:, 7] = -1
    mask[0, 100] = 0x5A5A5A5A
    grammar = GrammarOutput(ids, mask, None)
    frames = _wire(enc.encode_grammar(grammar))
    assert sum(map(len, frames)) < mask.nbytes // 10
    decoded = dec.decode_grammar(frames)
    assert_vllm_equal(grammar, decoded)
    decoded.grammar_bitmask[0, 0] = 1  # a fresh, writable array like pickle's


def test_grammar_ids_of_repeated_steps_are_fresh_and_exact() -> None:
    """Both ends keep the last step's structured request ids: a repeat still gives a
    fresh list, a list vLLM edits in place is sent as it is now, and ids outside the
    batch are never taken from the kept ones."""
    enc, dec = _pair()
    ids = list(_first(enc, dec).num_scheduled_tokens)

    def sent(request_ids: list[str]) -> tuple[list[str], list[str]]:
        mask = np.zeros((len(request_ids), 4), np.int32)
        got = dec.decode_grammar(_wire(enc.encode_grammar(GrammarOutput(request_ids, mask,
                                                                          None))))
        return list(got.structured_output_request_ids), got.structured_output_request_ids

    edited = ids[:2]
    assert sent(edited)[0] == ids[:2]
    twice, mine = sent(edited)
    assert twice == ids[:2]
    mine.append("edited by the runner")
    assert sent(edited)[0] == ids[:2]
    edited[0] = ids[2]  # vLLM's list, edited in place
    assert sent(edited)[0] == [ids[2], ids[1]]
    assert sent(["x-9", ids[0]])[0] == ["x-9", ids[0]]
    assert sent(["y-8", ids[0]])[0] == ["y-8", ids[0]]  # the same positions, another name
    assert sent([ids[1], ids[0]])[0] == [ids[1], ids[0]]


def test_grammar_rows_travel_by_reference_across_steps() -> None:
    """Rows the last bitmask held cost a reference: the encoder's and decoder's row tables
    advance together over steps, a step without grammar output leaves them."""
    enc, dec = _pair()
    ids = list(_first(enc, dec).num_scheduled_tokens)
    states = np.zeros((2, 128256 // 32 + 1), dtype=np.int32)  # Llama 3's vocabulary
    states[1] = -1
    states[:, 9] = 5
    sizes = []
    for picks in ([0, 1, 1], None, [1, 0, 0], [1, 1, 1]):
        grammar = None if picks is None else GrammarOutput(ids, states[picks], None)
        frames = _wire(enc.encode_grammar(grammar))
        sizes.append(sum(map(len, frames)))
        decoded = dec.decode_grammar(frames)
        assert_vllm_equal(grammar, decoded)
    assert max(sizes[2:]) < 60 < sizes[0], sizes


def test_a_real_vocabulary_bitmask_travels_as_sparse_words() -> None:
    enc, dec = _pair()
    ids = list(_first(enc, dec).num_scheduled_tokens)
    mask = np.full((len(ids), 128256 // 32 + 1), -1, dtype=np.int32)  # Llama 3's vocabulary
    mask[0] = 0
    mask[:, 4000] = 0x00FF00FF
    assert mask.nbytes > DEFLATE_MAX
    frames = _wire(enc.encode_grammar(GrammarOutput(ids, mask, None)))
    msg = msgspec.msgpack.decode(frames[0], type=GrammarMsg)
    assert msg.sparse is not None and msg.deflated is None and msg.bitmask is None
    assert sum(map(len, frames)) < 200
    assert_vllm_equal(GrammarOutput(ids, mask, None), dec.decode_grammar(frames))


def test_a_bitmask_sent_two_ways_is_malformed() -> None:
    enc, dec = _pair()
    ids = list(_first(enc, dec).num_scheduled_tokens)
    mask = np.zeros((len(ids), 512), dtype=np.int32)
    msg = msgspec.msgpack.decode(_wire(enc.encode_grammar(GrammarOutput(ids, mask, None)))[0],
                                 type=GrammarMsg)
    assert msg.deflated is not None
    twice = msgspec.structs.replace(msg, sparse=sparse_words(mask))
    with pytest.raises(MalformedMessage, match="more than one way"):
        dec.decode_grammar([msgspec.msgpack.encode(twice)])


def test_a_grammar_message_without_its_bitmask_frame_is_malformed() -> None:
    enc, dec = _pair()
    ids = list(_first(enc, dec).num_scheduled_tokens)
    dense = np.arange(len(ids) * 4, dtype=np.int32)  # 1-D: not by reference, sent as a frame
    frames = _wire(enc.encode_grammar(GrammarOutput(ids, dense, None)))
    assert len(frames) == 2
    with pytest.raises(MalformedMessage, match="tensor frame"):
        dec.decode_grammar(frames[:1])


def test_model_runner_output_round_trips() -> None:
    enc, dec = _pair()
    so = _first(enc, dec)
    ids = list(so.num_scheduled_tokens)
    lp = LogprobsLists(np.ones((len(ids), 3), np.int32), np.zeros((len(ids), 3), np.float32),
                       np.arange(len(ids), dtype=np.int32), None)
    out = ModelRunnerOutput(
        req_ids=ids[::-1], req_id_to_index={r: i for i, r in enumerate(ids[::-1])},
        sampled_token_ids=[[3, 4]] * len(ids), logprobs=lp,
        num_nans_in_logits={ids[0]: 0, "gone": 2, ids[-1]: 1},  # a name outside the batch
        prompt_token_id_logprobs_dict={ids[1]: torch.tensor([0.5, -1.0]),
                                       "gone": torch.tensor([2.0])},
        kv_connector_output=KVConnectorOutput(finished_sending={"gone"}, expected_finished_count=2))
    assert_vllm_equal(out, enc.decode_reply(_wire(dec.encode_reply(out))))
    assert enc.decode_reply(_wire(dec.encode_reply(None))) is None
    frames = _wire(dec.encode_reply(out))
    assert len(frames) > 1  # the logprobs arrays travel as frames
    with pytest.raises(MalformedMessage, match="tensor frame"):
        enc.decode_reply(frames[:1])  # the shared single-frame decoder refuses the refs


def test_one_token_replies_are_fresh_objects_every_time() -> None:
    """vLLM's common reply (one token per request, index = batch positions) takes the
    engine's shortcuts; each decoded reply is still made of fresh objects: a consumer
    that edits one cannot change the next."""
    enc, dec = _pair()
    ids = list(_first(enc, dec).num_scheduled_tokens)

    def reply(token: int) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=list(ids), req_id_to_index={r: i for i, r in
                                                                   enumerate(ids)},
                                 sampled_token_ids=[[token + i] for i in range(len(ids))])

    first = enc.decode_reply(_wire(dec.encode_reply(reply(5))))
    assert_vllm_equal(reply(5), first)
    first.req_id_to_index[ids[0]] = 99
    first.req_id_to_index["extra"] = 1
    first.sampled_token_ids[0].append(7)
    first.req_ids.append("extra")
    second = enc.decode_reply(_wire(dec.encode_reply(reply(9))))
    assert_vllm_equal(reply(9), second)
    two = reply(3)
    two.sampled_token_ids[1] = [1, 2]  # one request with two tokens: the general lists
    assert_vllm_equal(two, enc.decode_reply(_wire(dec.encode_reply(two))))


def test_hostile_reply_references_are_refused_typed() -> None:
    """A reply's index map that is not (ref, index) pairs, or a ref past the batch and
    its names, is refused as a typed error, not an IndexError."""
    enc, dec = _pair()
    _first(enc, dec)
    seq = enc.seq
    odd = ReplyMsg(seq=seq, index_map=pack_uints([0, 0, 1]))
    with pytest.raises(MalformedMessage, match="pairs"):
        enc.decode_reply([msgspec.msgpack.encode(odd)])
    past = ReplyMsg(seq=seq, index_map=pack_uints([0, 0, 999, 1]))
    with pytest.raises(RemoteProtocolError, match="out of range"):
        enc.decode_reply([msgspec.msgpack.encode(past)])
    with pytest.raises(RemoteProtocolError, match="out of range"):
        enc.decode_reply([msgspec.msgpack.encode(ReplyMsg(seq=seq, positions=pack_uints([999])))])
    short = ReplyMsg(seq=seq, tokens=b"\x01\x01\x00")  # one token for a bigger batch
    with pytest.raises(MalformedMessage, match="one per request"):
        enc.decode_reply([msgspec.msgpack.encode(short)])
    off = ReplyMsg(seq=seq, counts=pack_uints([2]), tokens=b"\x01\x01\x00")
    with pytest.raises(MalformedMessage, match="add up"):
        enc.decode_reply([msgspec.msgpack.encode(off)])
    for ref in (-1, 999):  # a negative ref read batch[-1] before: refused now
        nans = ReplyMsg(seq=seq, counts=pack_uints([]), nans=((0, 0), (ref, 1)))
        with pytest.raises(RemoteProtocolError, match="out of range"):
            enc.decode_reply([msgspec.msgpack.encode(nans)])


def test_bad_mac_is_refused_before_unpickling() -> None:
    from vllm_streams import OpaqueMeta

    enc = SchedulerOutputEncoder(secret=SECRET)
    dec = SchedulerOutputDecoder(secret=b"x" * 32)
    from vllm.v1.core.sched.output import SchedulerOutput

    so = SchedulerOutput.make_empty()
    so.kv_connector_metadata = OpaqueMeta("kv", [1])  # type: ignore[assignment]  # any object
    with pytest.raises(BadSeal):
        dec.decode(_wire(enc.encode(so)))
    assert dec.seq == 0 and dec.state is None  # refused before anything changed


def test_schema_pinning_refuses_an_unknown_field() -> None:
    check_schema()
    import dataclasses

    classes = vllm_classes()
    newer = dataclasses.make_dataclass(
        "SchedulerOutput", [("shiny_new_field", int, dataclasses.field(default=0))],
        bases=(classes["SchedulerOutput"],))
    with pytest.raises(SchemaMismatch, match="SchedulerOutput has field 'shiny_new_field'"):
        check_schema({**classes, "SchedulerOutput": newer})
    older = type("SamplingParams", (), {"__struct_fields__": ("n", "temperature")})
    with pytest.raises(SchemaMismatch, match="SamplingParams lacks field"):
        check_schema({**classes, "SamplingParams": older})


def test_record_file_round_trips_and_refuses_other_files(tmp_path: Path) -> None:
    from engine_side.report.record import NotARecording, RecordReader, RecordWriter

    path = tmp_path / "run.dcrec"
    with RecordWriter(path, meta={"model": "tiny"}) as w:
        w.write("execute_model", [b"abc", b"\x00\x01"])
        w.write("reply", [b"z"])
    r = RecordReader(path)
    assert r.meta["model"] == "tiny"
    assert [(k, [bytes(f) for f in fr]) for k, fr in r] == [
        ("execute_model", [b"abc", b"\x00\x01"]), ("reply", [b"z"])]
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(NotARecording):
        RecordReader(evil)


def test_recordings_are_format_2_and_format_1_files_still_read(tmp_path: Path) -> None:
    """Format 2 may hold grammar rows by reference, which a format-1 reader would drop
    silently: new files carry a magic such a reader refuses, and this reader still
    takes format-1 files (they never hold rows by reference)."""
    from engine_side.report.record import RecordReader, RecordWriter
    from protocol.recording import MAGIC, MAGIC_V1

    path = tmp_path / "run.dcrec"
    with RecordWriter(path) as w:
        w.write("sample_tokens", [b"g"])
    data = path.read_bytes()
    assert data.startswith(MAGIC) and not data.startswith(MAGIC_V1)
    assert RecordReader(path).header.format == 2
    old = tmp_path / "v1.dcrec"
    old.write_bytes(MAGIC_V1 + data[len(MAGIC):])
    assert [(k, [bytes(f) for f in fr]) for k, fr in RecordReader(old)] == [
        ("sample_tokens", [b"g"])]


def test_recording_of_another_protocol_major_is_refused(tmp_path: Path) -> None:
    """A protocol-1 file (no ``protocol`` in its header) carries protocol-1 digests:
    refused up front, naming both majors, rather than failing mid-replay."""
    import struct

    import msgspec

    from engine_side.report.record import RecordReader
    from protocol.errors import IncompatibleVersion
    from protocol.messages import PROTOCOL_MAJOR
    from protocol.recording import MAGIC_V1, RecordHeader

    old = tmp_path / "old.dcrec"
    header = msgspec.msgpack.encode(RecordHeader(1, "0.32.0", 1, {}, protocol=1))
    assert b"protocol" not in header  # how every protocol-1 file looks
    old.write_bytes(MAGIC_V1 + struct.pack("<I", len(header)) + header)
    with pytest.raises(IncompatibleVersion, match="record it again") as caught:
        RecordReader(old)
    assert (caught.value.ours, caught.value.theirs) == (PROTOCOL_MAJOR, 1) and PROTOCOL_MAJOR > 1


# ---------------------------------------------------------------- a real vLLM (CPU)
SCENARIOS = ("main", "spec")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_side.bench.vllm_scenarios import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "tiny-llama")


@pytest.fixture(scope="session")
def real_runs(tiny_model: Path) -> dict[str, tuple[dict[str, Any], Path]]:
    """Each scenario once, in a subprocess, with live strict checks and a recording."""
    import json
    import os
    import subprocess
    import sys

    runs = {}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    for name in SCENARIOS:
        out, rec = tiny_model.parent / f"{name}.json", tiny_model.parent / f"{name}.dcrec"
        proc = subprocess.run(
            [sys.executable, "-m", "engine_side.bench.vllm_streams", "--model", str(tiny_model),
             "--scenario", name, "--out", str(out), "--record", str(rec), "--check"],
            cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True,
            text=True, timeout=900)
        assert out.exists(), proc.stderr[-3000:]
        runs[name] = (json.loads(out.read_text()), rec)
    return runs


@pytest.mark.integration
def test_real_vllm_streams_round_trip_live(real_runs: dict[str, Any]) -> None:
    main, spec = real_runs["main"][0], real_runs["spec"][0]
    assert main["failures"] == [] and spec["failures"] == []
    seen = main["seen"]
    for scenario in ("preempted", "resumed", "chunked", "prefix_hit", "grammar", "all_token_ids"):
        assert seen.get(scenario, 0) > 0, f"main run never showed {scenario}: {seen}"
    assert spec["seen"]["spec_tokens"] > 0
    assert [len(o) for o in main["outputs"]][3] == 3  # n=3 parallel sampling


@pytest.mark.integration
@pytest.mark.parametrize("name", SCENARIOS)
def test_recorded_real_stream_replays_exactly(real_runs: dict[str, Any], name: str) -> None:
    from engine_side.report.record import RecordReader

    reader = RecordReader(real_runs[name][1])
    assert reader.header.vllm_version.startswith("0.32")
    dec, dec2 = SchedulerOutputDecoder(), SchedulerOutputDecoder()
    enc = SchedulerOutputEncoder()
    steps = 0
    for kind, frames in reader:
        if kind == "execute_model":
            so = dec.decode(frames)
            again = enc.encode(so)
            assert [bytes(f) for f in again] == [bytes(f) for f in frames]
            assert_vllm_equal(so, dec2.decode(_wire(again)))
            steps += 1
        elif kind == "sample_tokens":  # each decoded once, in order (row tables advance)
            grammar = dec.decode_grammar(frames)
            assert_vllm_equal(grammar, dec2.decode_grammar(_wire(enc.encode_grammar(grammar))))
    assert steps > 10


def test_sampling_params_from_equal_specs_are_exact_and_share_nothing() -> None:
    """The worker copies its last SamplingParams for a spec encoding to the same bytes:
    still equal in every field (an int temperature stays an int, -0.0 stays -0.0), and
    no list or set is shared with an earlier request's."""
    from vllm import SamplingParams

    from engine_side.vllm.params import SpecReader, sampling_to_spec
    from worker_side.vllm.params import SamplingMaker

    params = [SamplingParams(temperature=0.0, max_tokens=8, stop=["x"], stop_token_ids=[3]),
              SamplingParams(temperature=0.0, max_tokens=8, stop=["x"], stop_token_ids=[3]),
              SamplingParams(temperature=0, max_tokens=8, stop=["x"], stop_token_ids=[3]),
              SamplingParams(temperature=-0.0, max_tokens=8, stop=["x"], stop_token_ids=[3])]
    maker = SamplingMaker()
    made = []
    for sp in params:
        made.append(maker.make(*sampling_to_spec(sp)))
        assert_vllm_equal(sp, made[-1])
    assert type(made[2].temperature) is int and str(made[3].temperature) == "-0.0"
    copied = maker.make(*sampling_to_spec(params[0]))  # a copy of the one remembered
    for sp in (made[0], copied):  # the runner's own edits stay in its own object
        sp.stop.append("y")
        sp._all_stop_token_ids.add(99)
    assert_vllm_equal(params[0], maker.make(*sampling_to_spec(params[0])))
    assert_vllm_equal(params[1], made[1])
    reader = SpecReader()  # the engine's side: the last SamplingSpec again for equal bytes
    read = [reader.read(sp) for sp in params]
    assert read[1] == read[0] and read[2] != read[1] and read[3] != read[2]
    assert read == [sampling_to_spec(sp) for sp in params]
    assert read[2][1] == ("temperature",) and str(read[3][0].temperature) == "-0.0"
    # requests that differ in max_tokens or seed alone share the copy, each its own values
    varied = [SamplingParams(temperature=0.5, max_tokens=m, seed=s, stop=["x"])
              for m, s in ((8, None), (9, None), (None, 3), (8, 4), (7, None), (9, None))]
    made = [maker.make(*reader.read(sp)) for sp in varied]
    for sp, got in zip(varied, made, strict=True):
        assert_vllm_equal(sp, got)
        assert reader.read(sp) == sampling_to_spec(sp)
    assert len({id(got.stop) for got in made}) == len(made)
