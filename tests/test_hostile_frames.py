"""Hostile peers: any bytes through any public decode entry point raise only the
project's typed errors, and a receiving loop survives them.

Real frames (the golden fixtures, a plain step, replies, store refs and items, a
recording, and with vLLM the adapter's step, grammar and reply frames) are mutated --
bit flips, bytes, cuts, insertions, values nested past the interpreter's recursion
limit (msgspec raised RecursionError for those), frames dropped or duplicated -- and
fed to ``codec.decode``, ``codec.decode_plain``, ``replies.decode_reply``, the store
decoders, the recording reader, ``SchedulerOutputDecoder.decode`` / ``decode_grammar``
and ``SchedulerOutputEncoder.decode_reply``.  Whatever comes out must be a value or a
ProtocolError subclass (a crash in the C readers would kill pytest: a finding).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_side.transport import EngineTransport
from protocol import codec, replies
from protocol.errors import MalformedMessage, ProtocolError
from protocol.messages import CheckIn, Delta, DeltaBody, Goodbye, Rows
from protocol.packing import pack_uints
from protocol.recording import RecordReader, RecordWriter
from protocol.replies import StepResult, encode_reply, pack_tokens
from protocol.store_handles import PackedItem, decode_refs, encode_refs, make_handle, unpack_item
from worker_side.transport import channel_endpoints

GOLDEN = Path(__file__).parent / "golden"
HAS_VLLM = importlib.util.find_spec("vllm") is not None
DEEP = 1000  # values nested this deep exceed the recursion limit (1000) inside msgspec
SECRET = b"h" * 32


def _golden() -> dict[str, list[bytes]]:
    return {p.stem: [bytes.fromhex(line) for line in p.read_text().split()]
            for p in sorted(GOLDEN.glob("*.hex"))}


def nested(depth: int) -> bytes:
    """A msgpack value nested ``depth`` arrays deep: ``[[[...nil...]]]``."""
    return b"\x91" * depth + b"\xc0"


def with_nested_field(frame: bytes, depth: int = DEEP) -> bytes | None:
    """``frame`` (a msgpack array or map at the top) with one more element: a value
    nested ``depth`` deep (under the key "zz" for a map); None for another frame.  A
    decoder skips an unknown trailing field -- and msgspec recurses to skip it."""
    if not frame:
        return None
    head, rest, value = frame[0], frame[1:], nested(depth)
    if head & 0xF0 == 0x90 and head != 0x9F:  # fixarray of up to 14
        return bytes([head + 1]) + rest + value
    if head & 0xF0 == 0x80 and head != 0x8F:  # fixmap of up to 14
        return bytes([head + 1]) + rest + b"\xa2zz" + value
    if head in (0xDC, 0xDE) and len(frame) >= 3 and frame[1:3] != b"\xff\xff":  # 16-bit
        n = int.from_bytes(frame[1:3], "big") + 1
        return bytes([head]) + n.to_bytes(2, "big") + frame[3:] + \
            (b"\xa2zz" if head == 0xDE else b"") + value
    return None


def test_the_reported_nested_reply_is_malformed_not_a_recursion_error() -> None:
    frame = encode_reply(StepResult(0, 1, rank=0))
    n = frame[0] & 0x0F
    bad = bytes([0x90 | (n + 1)]) + frame[1:] + b"\x91" * 1000 + b"\xc0"
    assert bad == with_nested_field(frame)
    with pytest.raises(MalformedMessage, match="RecursionError"):
        replies.decode_reply([bad])
    with pytest.raises(MalformedMessage):
        codec.decode([with_nested_field(_golden()["delta"][0])])  # type: ignore[list-item]


@st.composite
def mutated(draw: Any, seeds: list[list[bytes]]) -> list[bytes]:
    """One of ``seeds`` (lists of frames) mutated one way."""
    frames = list(draw(st.sampled_from(seeds)))
    k = draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[k])
    how = draw(st.sampled_from(["flip", "byte", "cut", "insert", "nest_tail", "nest_at",
                                "drop_frame", "dup_frame"]))
    event(how)
    if how == "nest_tail":
        frames[k] = with_nested_field(frames[k], draw(st.sampled_from([DEEP, 5000]))) or b""
        return frames
    if how == "drop_frame":
        return frames[:k] + frames[k + 1:]
    if how == "dup_frame":
        return frames[:k + 1] + frames[k:]
    i = draw(st.integers(0, max(len(raw) - 1, 0)))
    if how == "flip" and raw:
        raw[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "byte" and raw:
        raw[i] = draw(st.integers(0, 255))
    elif how == "cut":
        del raw[i:]
    elif how == "nest_at":
        raw[i:i] = nested(draw(st.sampled_from([1, 30, DEEP, 5000])))
    else:
        raw.insert(i, draw(st.integers(0, 255)))
    frames[k] = bytes(raw)
    return frames


def typed(decode: Callable[[list[bytes]], Any], frames: list[bytes]) -> None:
    """Decode ``frames``: a value or a ProtocolError, anything else fails the test."""
    try:
        decode(frames)
        event("decoded")
    except ProtocolError as exc:
        event(type(exc).__name__)


def _one(frames: list[bytes]) -> bytes:
    """The frame of a single-frame input (a mutation may have dropped it)."""
    return frames[0] if frames else b""


# ---------------------------------------------------------------- the core decoders
def _plain_frame() -> bytes:
    body = DeltaBody(block_append=(Rows(handles=pack_uints([0, 2]), values=pack_uints([7, 9])),),
                     has_structured_output=True)
    return bytes(codec.encode(Delta(3, 5, 77, body))[0])


CORE_SEEDS = [*_golden().values(), [_plain_frame()], [b""], [b"\x90"]]
REPLY_SEEDS = [[encode_reply(m)] for m in (
    StepResult(2, 9, rank=1, rows=pack_tokens([0, 3]), tokens=pack_tokens([5, 6]),
               rejoined=True),
    CheckIn(epoch=2, seq=9, rank=3, state="synced", token_hash=5, pid=7),
    Goodbye(epoch=2, seq=9, reason="bye"))]


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated(CORE_SEEDS))
def test_codec_decode_raises_only_typed_errors(frames: list[bytes]) -> None:
    typed(codec.decode, frames)
    typed(lambda f: codec.decode(f, copy=True), frames)
    for frame in frames:
        plain = codec.decode_plain(frame)  # a value or None, never an exception
        assert plain is None or plain.body is not None
        assert codec.may_be_plain(frame) in (True, False)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated(REPLY_SEEDS + CORE_SEEDS[:3]))
def test_decode_reply_raises_only_typed_errors(frames: list[bytes]) -> None:
    typed(replies.decode_reply, frames)


def _item() -> tuple[bytes, int]:
    packed = PackedItem({"pixels": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
                         "meta": ["a", 1, {"b": 2.5}]})
    dest = bytearray(packed.length)
    packed.write_into(memoryview(dest))
    return bytes(dest), len(packed.layout)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated([[encode_refs([make_handle(SECRET, "img-1", 3, 9), "img-2"])]]))
def test_store_refs_raise_only_typed_errors(frames: list[bytes]) -> None:
    typed(lambda f: decode_refs(_one(f)), frames)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated([[_item()[0]]]), layout_cut=st.integers(-8, 8))
def test_store_items_raise_only_typed_errors(frames: list[bytes], layout_cut: int) -> None:
    layout_len = _item()[1] + layout_cut
    typed(lambda f: unpack_item(memoryview(_one(f)), layout_len), frames)


def test_nested_layouts_bodies_and_headers_are_refused_typed() -> None:
    """The containers the byte mutations above cannot reach: an item's layout (at its
    end) and body, and a recording's header."""
    import msgspec

    from protocol.recording import MAGIC, NotARecording
    from protocol.store_handles import ItemLayout

    data, layout_len = _item()
    layout = data[-layout_len:]
    for bad in (with_nested_field(layout),
                msgspec.msgpack.encode(ItemLayout(nested(DEEP), [], []))):
        assert bad is not None
        with pytest.raises(MalformedMessage, match="RecursionError"):
            unpack_item(memoryview(data[:-layout_len] + bad), len(bad))
    refs = encode_refs(["a", "b"])
    with pytest.raises(MalformedMessage):
        decode_refs(with_nested_field(refs))
    header = _recording()[len(MAGIC) + 4:]
    header = header[:int.from_bytes(_recording()[len(MAGIC):len(MAGIC) + 4], "little")]
    bad = with_nested_field(header)
    assert bad is not None
    with tempfile.NamedTemporaryFile(suffix=".rec") as f:
        f.write(MAGIC + len(bad).to_bytes(4, "little") + bad)
        f.flush()
        with pytest.raises(NotARecording, match="corrupt header"):
            RecordReader(f.name)


def _recording() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.rec"
        with RecordWriter(path, meta={"model": "toy"}) as writer:
            for frames in [*_golden().values(), [_plain_frame()]]:
                writer.write("execute_model", frames)
            writer.write("reply", REPLY_SEEDS[0])
        return path.read_bytes()


def _read_recording(data: bytes) -> None:
    with tempfile.NamedTemporaryFile(suffix=".rec") as f:
        f.write(data)
        f.flush()
        for kind, frames in RecordReader(f.name):
            decode = codec.decode if kind == "execute_model" else replies.decode_reply
            typed(decode, [bytes(x) for x in frames])


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated([[_recording()]]))
def test_the_recording_reader_raises_only_typed_errors(frames: list[bytes]) -> None:
    typed(lambda f: _read_recording(_one(f)), frames)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated([[_recording()]]))
def test_the_reports_recording_reader_refuses_with_value_error(frames: list[bytes]) -> None:
    from engine_side.report.workloads import load_workload

    with tempfile.NamedTemporaryFile(suffix=".rec") as f:
        f.write(_one(frames))
        f.flush()
        try:
            source = load_workload(f.name, steps=4, batch=None, seed=0)
            list(source.requests)
        except ValueError:
            event("refused")


# ---------------------------------------------------------------- a receiving loop
def _recv_until(engine: EngineTransport, want: int) -> list[tuple[bytes, Any]]:
    got: list[tuple[bytes, Any]] = []
    for _ in range(200):  # (bounded: each round waits at most 50 ms)
        got += engine.recv(50)
        if len(got) >= want:
            break
    return got


@pytest.mark.integration
def test_engine_transport_survives_hostile_frames_counts_them_per_peer_and_serves_on(
        caplog: pytest.LogCaptureFixture) -> None:
    base = Path(tempfile.mkdtemp(prefix="dch-", dir="/tmp"))  # (ipc paths stay short)
    engine = EngineTransport(f"ipc://{base}/e", ring_bytes=0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peers = []
    try:
        for name in (b"bad-1", b"bad-2"):
            sock = ctx.socket(zmq.DEALER)
            sock.linger, sock.identity = 0, name
            sock.connect(channel_endpoints(engine.endpoint)[1])
            peers.append(sock)
        good = encode_reply(StepResult(4, 2, rank=1, tokens=pack_tokens([3])))
        caplog.set_level(logging.WARNING, logger="deltacast.engine.transport")
        for _ in range(3):  # the reported nested frame, three times from one peer
            peers[0].send(with_nested_field(good))  # type: ignore[arg-type]
        peers[1].send(b"\xc1 not msgpack")
        peers[1].send_multipart([good, good])  # a reply is exactly one frame
        peers[0].send(good)  # then a good message: still served
        got = _recv_until(engine, 1)
        for _ in range(200):  # the bad ones may come after the good one (fair queueing)
            if engine.malformed >= 5:
                break
            got += engine.recv(50)
        assert [(who, type(msg)) for who, msg in got] == [(b"bad-1", StepResult)]
        assert got[0][1].token_array().tolist() == [3]
        assert engine.malformed == 5
        assert engine.faults.by_peer == Counter({b"bad-1": 3, b"bad-2": 2})
        warnings = [r.getMessage() for r in caplog.records if "does not decode" in r.getMessage()]
        assert len(warnings) == 2  # once per peer, not per message
        assert any("RecursionError" in w and "bad-1" in w for w in warnings)
    finally:
        for sock in peers:
            sock.close(linger=0)
        ctx.term()
        engine.close()
        shutil.rmtree(base, ignore_errors=True)


def test_peer_faults_are_bounded_per_peer_and_in_number(caplog: pytest.LogCaptureFixture,
                                                        ) -> None:
    from protocol.faults import OTHER_PEERS, PeerFaults

    faults = PeerFaults(logging.getLogger("test.faults"), "dropped", max_peers=2)
    caplog.set_level(logging.WARNING, logger="test.faults")
    for peer in (b"a", b"a", b"b", b"c", b"d", b"a"):
        faults.hit(peer, MalformedMessage("bad"))
    assert faults.total == 6
    assert faults.by_peer == Counter({b"a": 3, b"b": 1, OTHER_PEERS: 2})
    assert len(caplog.records) == 3  # a, b, and the others once for all


# ---------------------------------------------------------------- the vLLM adapter
def _vllm_pair() -> tuple[Any, Any, list[str]]:
    """An encoder and a decoder after one first step of three new requests."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    from engine_side.vllm import SchedulerOutputEncoder
    from worker_side.vllm import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(SECRET)
    ids = ["a", "b", "c"]
    new = [NewRequestData(rid, [1, 2, 3, k], [], SamplingParams(temperature=0), None,
                          ([k + 1],), 0, None) for k, rid in enumerate(ids)]
    dec.decode([bytes(f) for f in enc.encode(SchedulerOutput(
        new, CachedRequestData.make_empty(), dict.fromkeys(ids, 4), 12, {}, {}, set(), [],
        preempted_req_ids=set()))])
    return enc, dec, ids


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_vllm_step_frames_nested_or_mutated_raise_only_typed_errors(data: st.DataObject,
                                                                    ) -> None:
    import copy

    from vllm_streams import scheduler_streams

    from engine_side.vllm import SchedulerOutputEncoder
    from worker_side.vllm import SchedulerOutputDecoder

    stream = data.draw(scheduler_streams(max_steps=6), label="stream")
    enc = SchedulerOutputEncoder(secret=SECRET)
    steps = [[bytes(f) for f in enc.encode(copy.deepcopy(so))] for so in stream["steps"]]
    at = data.draw(st.integers(0, len(steps) - 1), label="step")
    dec = SchedulerOutputDecoder(SECRET)
    for frames in steps[:at]:
        dec.decode(frames)
    typed(dec.decode, data.draw(mutated([steps[at]]), label="frames"))
    typed(dec.decode_grammar, data.draw(mutated([steps[at]]), label="as grammar"))


def _grammar_seeds(enc: Any, ids: list[str]) -> list[list[bytes]]:
    from vllm.v1.core.sched.output import GrammarOutput

    rows = np.zeros((3, 512), dtype=np.int32)  # deflated (mostly zero rows)
    rows[:, 7], rows[1, 100] = -1, 0x5A5A
    big = np.full((3, 2048), -1, dtype=np.int32)  # sparse words (past DEFLATE_MAX)
    big[0, 5] = 3
    masks = [np.arange(12, dtype=np.int32).reshape(3, 4), rows, rows, big]  # rows twice:
    return [[bytes(f) for f in enc.encode_grammar(GrammarOutput(ids, m, [1, 0, 2]))]
            for m in masks]  # (the second by reference to the first)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_vllm_grammar_frames_raise_only_typed_errors(data: st.DataObject) -> None:
    enc, dec, ids = _vllm_pair()
    seeds = _grammar_seeds(enc, ids)
    k = data.draw(st.integers(0, len(seeds) - 1))
    for frames in seeds[:k]:
        dec.decode_grammar(frames)
    typed(dec.decode_grammar, data.draw(mutated(seeds[k:k + 1])))


def _reply_seeds(dec: Any, ids: list[str]) -> list[list[bytes]]:
    from vllm.v1.outputs import KVConnectorOutput, LogprobsLists, ModelRunnerOutput

    plain = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                              sampled_token_ids=[[5]] * len(ids))
    lp = LogprobsLists(np.ones((3, 2), np.int32), np.zeros((3, 2), np.float32),
                       np.arange(3, dtype=np.int32), None)
    rich = ModelRunnerOutput(
        req_ids=ids[::-1], req_id_to_index={r: i for i, r in enumerate(ids[::-1])},
        sampled_token_ids=[[3, 4], [], [5]], logprobs=lp,
        num_nans_in_logits={ids[0]: 0, "gone": 2},
        kv_connector_output=KVConnectorOutput(finished_sending={"gone"},
                                              expected_finished_count=2),
        ec_connector_output={"sealed": [1, 2]})  # (an opaque object: travels sealed)
    return [[bytes(f) for f in dec.encode_reply(out)] for out in (plain, rich, None)]


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_vllm_reply_frames_raise_only_typed_errors(data: st.DataObject) -> None:
    enc, dec, ids = _vllm_pair()
    seeds = _reply_seeds(dec, ids)
    typed(enc.decode_reply, data.draw(mutated(seeds)))


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_a_malformed_answer_fails_the_executor_naming_the_rank() -> None:
    """The executor's reading of its ranks' answers (no processes: its receive is
    stubbed with the frames two ranks sent): a malformed reply from the output rank
    fails the executor cleanly -- ExecutorFailed naming the rank, failed, called back."""
    from engine_side.vllm.answers import Answers
    from engine_side.vllm.executor import DeltaExecutor, ExecutorFailed
    from protocol.faults import PeerFaults
    from protocol.seal import Opener, Sealer
    from worker_side.vllm import proc

    def executor(answers: list[list[bytes]]) -> tuple[Any, list[int]]:
        ex: Any = object.__new__(DeltaExecutor)
        called: list[int] = []
        ex.world_size, ex.output_rank, ex.stats = 2, 1, Counter()
        ex._answers, ex.is_failed, ex.failure = Answers(2, ex.stats), False, ""
        ex.faults = PeerFaults(logging.getLogger("test.executor"), "dropped")
        ex.failure_callback = lambda: called.append(1)
        ex.encoder = _vllm_pair()[0]
        ex._open_result = [Opener(SECRET, b"result:%d" % r) for r in range(2)]
        ex._receive = lambda deadline: list(enumerate(answers))
        return ex, called

    reply = [proc.OUTPUT, with_nested_field(_reply_seeds(_vllm_pair()[1], ["a"])[0][0])]
    ex, called = executor([[proc.DONE], reply])  # type: ignore[list-item]
    with pytest.raises(ExecutorFailed, match="rank 1 sent a malformed answer"):
        ex._output(ex._gather(None))
    assert ex.is_failed and called == [1] and ex.faults.by_peer == Counter({"rank 1": 1})
    ex, called = executor([[b"?"], [proc.DONE]])  # not an answer at all
    with pytest.raises(ExecutorFailed, match="rank 0"):
        ex._gather(None)
    sealer = Sealer(SECRET, b"result:0")  # rank 0's result sent as rank 1's
    ex, called = executor([[proc.CONTROL, sealer.seal({"result": 1})],
                           [proc.CONTROL, sealer.seal({"result": 2})]])
    with pytest.raises(ExecutorFailed, match="rank 1 .*MAC"):
        ex._results(ex._gather(None))
    assert called == [1]
    assert proc.rank_of(b"1", 2) == 1
    assert [proc.rank_of(i, 2) for i in (b"2", b"01", b"-1", b"x", b"", b"1" * 9)] == [None] * 6
