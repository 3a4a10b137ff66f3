"""Hostile peers: any bytes through any public decode entry point of the core raise
only the project's typed errors, and a receiving loop survives them.

Real frames (the golden fixtures, a step with block rows, replies, store refs and
items, a recording) are mutated -- bit flips, bytes, cuts, insertions, values nested
past the interpreter's recursion limit (msgspec raised RecursionError for those),
frames dropped or duplicated -- and fed to ``codec.decode``, ``replies.decode_reply``,
the store decoders, the recording reader and the executor channel's parsers
(``protocol.calls``, ring records); messages Hypothesis builds from
well-formed msgpack of any shape go through ``codec.decode`` and, when they decode to a
Delta, a replica state's ``apply``.  Whatever comes out must be a value or a
ProtocolError subclass (a crash in the C readers would kill pytest: a finding).  The
vLLM adapter's decoders: ``test_hostile_vllm.py``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
from hostile import DEEP, SECRET, golden, mutated, nested, one, typed, with_nested_field
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from oracle import state_fingerprint
from replica_bodies import first_step

from engine_side.bench.fuzz_corpus import call_seeds, read_call
from engine_side.transport import EngineTransport
from protocol import calls, codec, replies
from protocol.endpoints import channel_endpoints
from protocol.errors import MalformedMessage, ProtocolError
from protocol.messages import MESSAGE_TYPES, CheckIn, Delta, DeltaBody, Goodbye, Rows
from protocol.packing import pack_uints
from protocol.recording import RecordReader, RecordWriter
from protocol.replies import StepResult, encode_reply, pack_tokens
from protocol.store_handles import PackedItem, decode_refs, encode_refs, make_handle, unpack_item


def test_the_reported_nested_reply_is_malformed_not_a_recursion_error() -> None:
    frame = encode_reply(StepResult(0, 1, rank=0))
    n = frame[0] & 0x0F
    bad = bytes([0x90 | (n + 1)]) + frame[1:] + b"\x91" * 1000 + b"\xc0"
    assert bad == with_nested_field(frame)
    with pytest.raises(MalformedMessage, match="RecursionError"):
        replies.decode_reply([bad])
    with pytest.raises(MalformedMessage):
        codec.decode([with_nested_field(golden()["delta"][0])])  # type: ignore[list-item]



# ---------------------------------------------------------------- the core decoders
def _rows_frame() -> bytes:
    body = DeltaBody(block_append=(Rows(keys=pack_uints([0, 2]), values=pack_uints([7, 9])),),
                     has_structured_output=True)
    return bytes(codec.encode(Delta(3, 5, 77, body))[0])


CORE_SEEDS = [*golden().values(), [_rows_frame()], [b""], [b"\x90"]]
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


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated(REPLY_SEEDS + CORE_SEEDS[:3]))
def test_decode_reply_raises_only_typed_errors(frames: list[bytes]) -> None:
    typed(replies.decode_reply, frames)



#: well-formed msgpack values of any shape (what a peer that speaks msgpack may send)
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=6) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["f", "a", "sd", "sa", "nt", "nc", "ba", "ot", "r", "x", "h", "n", "v",
                         "sf", "tr", "s", "c", "zz"]), inner, max_size=4),
    max_leaves=12)
_PACKED = st.one_of(st.lists(st.integers(0, 40), max_size=6).map(pack_uints),
                    st.binary(max_size=10))
_BODY = st.fixed_dictionaries({}, optional={
    "f": _PACKED, "sd": _PACKED, "sa": _PACKED, "so": st.booleans(), "x": st.binary(max_size=8),
    "nt": st.fixed_dictionaries({}, optional={"h": _PACKED, "v": _PACKED}),
    "nc": st.fixed_dictionaries({}, optional={"h": _PACKED, "v": _PACKED}),
    "ba": st.lists(st.fixed_dictionaries({}, optional={"h": _PACKED, "n": _PACKED,
                                                       "v": _PACKED}), max_size=3),
    "r": st.fixed_dictionaries({}, optional={"sf": _PACKED, "pe": _PACKED, "fx": st.lists(
        st.text(max_size=3), max_size=2)})})


@st.composite
def _messages(draw: Any) -> bytes:
    """A message header (a real tag, or not) and fields Hypothesis picks: any msgpack, or
    for a Delta a body map of real keys holding packed arrays or any bytes."""
    head = [draw(st.sampled_from([c.__struct_config__.tag for c in MESSAGE_TYPES] + [0, 9])),
            draw(st.integers(0, 3)), draw(st.integers(-1, 3))]
    if draw(st.integers(0, 3)):  # mostly a Delta with a body map
        head[0] = Delta.__struct_config__.tag
        return msgspec.msgpack.encode([*head, draw(st.integers(0, (1 << 64) - 1)), draw(_BODY)])
    return msgspec.msgpack.encode(head + draw(st.lists(_VALUES, max_size=4)))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frame=_messages())
def test_generated_messages_decode_and_apply_or_raise_typed(frame: bytes) -> None:
    """Whatever decodes applies to a live replica state or is refused typed, the state
    then unchanged."""
    msg = typed(codec.decode, [frame])
    if not isinstance(msg, Delta):
        return
    mirror, _ = first_step(4, 1)
    state = mirror.state
    before = state_fingerprint(state)
    try:
        state.apply(msg.body)
        event("applied")
    except ProtocolError as exc:
        event(f"apply: {type(exc).__name__}")
        assert state_fingerprint(state) == before


def _item() -> tuple[bytes, int]:
    packed = PackedItem({"pixels": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
                         "meta": ["a", 1, {"b": 2.5}]})
    dest = bytearray(packed.length)
    packed.write_into(memoryview(dest))
    return bytes(dest), len(packed.layout)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated([[encode_refs([make_handle(SECRET, "img-1", 3, 9), "img-2"])]]))
def test_store_refs_raise_only_typed_errors(frames: list[bytes]) -> None:
    typed(lambda f: decode_refs(one(f)), frames)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated([[_item()[0]]]), layout_cut=st.integers(-8, 8))
def test_store_items_raise_only_typed_errors(frames: list[bytes], layout_cut: int) -> None:
    layout_len = _item()[1] + layout_cut
    typed(lambda f: unpack_item(memoryview(one(f)), layout_len), frames)


def test_nested_layouts_bodies_and_headers_are_refused_typed() -> None:
    """The containers the byte mutations above cannot reach: an item's layout (at its
    end) and body, and a recording's header."""
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
            for frames in [*golden().values(), [_rows_frame()]]:
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
    typed(lambda f: _read_recording(one(f)), frames)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(frames=mutated([[_recording()]]))
def test_the_reports_recording_reader_refuses_with_value_error(frames: list[bytes]) -> None:
    from engine_side.report.workloads import load_workload

    with tempfile.NamedTemporaryFile(suffix=".rec") as f:
        f.write(one(frames))
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



# ---------------------------------------------------------------- the executor channel
CALL_SEEDS = call_seeds()  # each message kind of the channel (SPEC §16) with its parser


@pytest.mark.parametrize("seed", CALL_SEEDS, ids=[f"{k}-{i}" for i, (k, _) in
                                                  enumerate(CALL_SEEDS)])
@settings(max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_executor_channels_parsers_raise_only_typed_errors(
        seed: tuple[str, list[bytes]], data: st.DataObject) -> None:
    kind, frames = seed
    assert typed(lambda f: read_call(kind, f), frames) is not None  # the seed itself reads
    typed(lambda f: read_call(kind, f), data.draw(mutated([frames])))


def test_a_hello_nested_past_the_recursion_limit_is_malformed() -> None:
    """json.loads raised RecursionError from a remote rank's hello of 4 kB of brackets
    (the engine's start-up failed with it)."""
    for bad in (b"[" * 4000, b'{"node": ' + b"[" * 2000 + b"]" * 2000 + b"}"):
        with pytest.raises(MalformedMessage):
            calls.parse_hello(bad)
