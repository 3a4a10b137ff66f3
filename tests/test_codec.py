"""Frames ⇄ messages (protocol.codec): round-trips, frame counts, buffer lifetime, bad input.

Buffer-lifetime rule (SPEC §11, and the bug of vLLM #53217, where a sender reused
a tensor whose memory a ``copy=False`` send still referenced):

* ``codec.encode`` does not copy contiguous tensors: each extra frame *is* the
  sender's tensor memory.  After ``send_multipart(frames, copy=False,
  track=True)`` the sender MUST NOT mutate those tensors until
  ``tracker.wait()`` returns (or ``tracker.done``).  Over ``inproc://`` zmq hands
  the very buffer to the receiver, so the tracker completes only once the
  receiver has released the received frames.
* A receiver that keeps decoded tensors beyond the frames' lifetime, or that
  must not see later writes to them, decodes with ``copy=True``; with
  ``copy=False`` the tensors alias the frames (and, over inproc, the sender).

Sizes asserted here are golden: they were measured, and a change is a wire change.
"""

from __future__ import annotations

import functools
import gc
import itertools
from typing import Any

import hypothesis.extra.numpy as hnp
import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_side.mirror import EngineMirror
from protocol import codec
from protocol.errors import MalformedMessage
from protocol.messages import (
    MESSAGE_TYPES,
    CheckIn,
    Delta,
    DeltaBody,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    NewRequest,
    Rows,
    Snapshot,
    SnapshotBody,
    SnapshotRequest,
)
from protocol.packing import pack_uints
from protocol.params import (
    LoRASpec,
    MMFeatureRef,
    PoolingSpec,
    RepetitionDetectionSpec,
    SamplingSpec,
    StructuredOutputsSpec,
)
from protocol.plan import STEADY_BODY
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, requests_equal
from protocol.tensors import tensors_equal
from worker_side import events as ev
from worker_side.replica import State, WorkerReplica

# ---------------------------------------------------------------- strategies

ints = st.integers(-(2**63), 2**64 - 1)  # every int msgpack carries
u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 2**31)
text = st.text(max_size=6)
floats = st.floats(allow_nan=False, width=64)
packed = st.lists(st.integers(0, 2**40), max_size=12).map(pack_uints)
maybe_packed = st.just(b"") | packed
int_lists = st.lists(st.integers(-(2**31), 2**31), max_size=4)
json_like = st.recursive(
    st.none() | st.booleans() | ints | floats | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=6,
)


@st.composite
def tensors(draw: st.DrawFn) -> Any:
    """The zoo: numpy and torch, bf16, 0-d, empty and non-contiguous tensors."""
    dtype = np.dtype(draw(st.sampled_from(["float32", "float16", "int64", "uint8", "bool"])))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    arr = draw(hnp.arrays(dtype, shape))
    if arr.ndim >= 2 and draw(st.booleans()):
        arr = arr.T
    kind = draw(st.sampled_from(["numpy", "torch", "bf16"]))
    if kind == "numpy":
        return arr
    t = torch.from_numpy(np.array(arr))
    if kind == "bf16" and dtype.kind == "f":
        t = t.to(torch.bfloat16)
    return t[::2] if t.ndim and draw(st.booleans()) else t


nested_tensors = st.recursive(
    tensors() | st.integers(0, 9) | text,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(text, kids, max_size=3),
    max_leaves=5,
)

_SAMPLING_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(2, 8), "presence_penalty": floats, "frequency_penalty": floats,
    "repetition_penalty": floats, "temperature": floats, "watermarking": st.booleans(),
    "top_p": floats, "top_k": st.integers(-1, 1000), "min_p": floats, "seed": ints,
    "stop": st.lists(text, max_size=3), "stop_token_ids": int_lists,
    "ignore_eos": st.booleans(), "max_tokens": st.none() | small, "min_tokens": small,
    "logprobs": st.none() | small, "prompt_logprobs": small,
    "prompt_logprob_token_ids": st.lists(int_lists, max_size=2),
    "prompt_logprob_start": small, "logprob_token_ids": int_lists,
    "flat_logprobs": st.booleans(), "detokenize": st.booleans(),
    "skip_special_tokens": st.booleans(), "spaces_between_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(), "output_kind": st.integers(0, 2),
    "stream_interval": small, "skip_clone": st.booleans(),
    "output_text_buffer_length": small, "eos_token_id": small,
    "all_stop_token_ids": int_lists, "watermarking_skipped": st.booleans(),
    "structured_outputs": st.builds(StructuredOutputsSpec, json=st.none() | text,
                                    regex=st.none() | text, choice=st.none() | st.lists(text),
                                    disable_any_whitespace=st.booleans()),
    "logit_bias": st.dictionaries(st.integers(0, 2**17), floats, max_size=3),
    "allowed_token_ids": int_lists, "extra_args": st.dictionaries(text, json_like, max_size=3),
    "bad_words": st.lists(text, max_size=3), "bad_words_token_ids": st.lists(int_lists, max_size=2),
    "skip_reading_prefix_cache": st.booleans(), "thinking_token_budget": small,
    "repetition_detection": st.builds(RepetitionDetectionSpec, small, small, small),
    "routed_experts_prompt_start": small, "trace_decode_token_ids": int_lists,
}  # fmt: skip
sampling_specs = st.fixed_dictionaries({}, optional=_SAMPLING_VALUES).map(
    lambda fields: SamplingSpec(**fields)
)
pooling_specs = st.fixed_dictionaries({}, optional={
    "use_activation": st.booleans(), "dimensions": small, "task": text,
    "returned_token_ids": int_lists, "requires_token_ids": st.booleans(),
    "extra_kwargs": st.dictionaries(text, json_like, max_size=2), "output_kind": small,
}).map(lambda fields: PoolingSpec(**fields))  # type: ignore[arg-type]  # fmt: skip
lora_specs = st.builds(LoRASpec, lora_name=text, lora_int_id=small, lora_path=text,
                       base_model_name=st.none() | text, load_inplace=st.booleans())
mm_features = st.builds(MMFeatureRef, modality=text, identifier=text, offset=small, length=small,
                        mm_hash=st.none() | text, data=st.none() | nested_tensors,
                        is_embed=st.none() | tensors())
new_requests = st.builds(
    NewRequest, handle=st.integers(0, 2**24), req_id=text, prompt=maybe_packed,
    prefix_handle=st.integers(-1, 99), prefix=small, prompt_none=st.booleans(),
    sampling=st.none() | sampling_specs, pooling=st.none() | pooling_specs,
    lora=st.none() | lora_specs, mm_features=st.lists(mm_features, max_size=2).map(tuple),
    prompt_embeds=st.none() | tensors(),
    prompt_is_token_ids=st.none() | st.lists(st.booleans(), max_size=4).map(tuple),
    num_computed=small, output=maybe_packed,
)
rows = st.builds(Rows, handles=maybe_packed, counts=maybe_packed, values=maybe_packed)
_DELTA_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "finished": packed, "finished_unknown": st.lists(text, max_size=2).map(tuple),
    "added": st.lists(new_requests, max_size=2).map(tuple), "schedule_full": packed,
    "schedule_drop": packed, "schedule_append": packed, "scheduled_tokens": rows,
    "computed_tokens": rows, "block_replace": st.lists(rows, max_size=2).map(tuple),
    "block_append": st.lists(rows, max_size=2).map(tuple), "truncate": rows, "tokens": rows,
    "spec_tokens": rows, "encoder_inputs": rows, "preempted": packed, "resumed": packed,
    "free_encoder_mm_hashes": st.lists(text, max_size=2).map(tuple), "blocks_to_zero": packed,
    "has_structured_output": st.booleans(), "pending_structured_output": st.booleans(),
    "num_spec_tokens_to_schedule": small,
    "extension": st.dictionaries(text, st.binary(max_size=8), max_size=2),
}  # fmt: skip
delta_bodies = st.fixed_dictionaries({}, optional=_DELTA_VALUES).map(lambda f: DeltaBody(**f))
snapshot_bodies = st.builds(
    SnapshotBody, token_mode=st.integers(0, 1), kv_groups=st.integers(1, 4),
    requests=st.lists(new_requests, max_size=2).map(tuple),
    blocks=st.lists(rows, max_size=2).map(tuple), schedule=maybe_packed,
    scheduled_tokens=maybe_packed,
)
MESSAGES: dict[type[Message], st.SearchStrategy[Any]] = {
    Hello: st.builds(Hello, ints, ints, major=ints, minor=ints, features=ints, role=text,
                     rank=ints),
    Goodbye: st.builds(Goodbye, ints, ints, reason=text),
    Heartbeat: st.builds(Heartbeat, ints, ints, digest=u64),
    Delta: st.builds(Delta, ints, ints, digest=u64, body=delta_bodies),
    Snapshot: st.builds(Snapshot, ints, ints, digest=u64, body=snapshot_bodies),
    CheckIn: st.builds(CheckIn, ints, ints, rank=ints, state=text, token_hash=u64,
                       token_hash_seq=ints, pid=ints),
    SnapshotRequest: st.builds(SnapshotRequest, ints, ints, rank=ints),
}
any_message = st.one_of(list(MESSAGES.values()))


def assert_same(a: Any, b: Any, path: str = "msg") -> None:
    """Deep equality; tensors compare bitwise and must keep their library and dtype."""
    if isinstance(a, msgspec.Struct):
        assert type(a) is type(b), path
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (np.ndarray, torch.Tensor)):
        assert type(b) is type(a) and tensors_equal(a, b), path
    else:
        assert type(a) is type(b) and a == b, path


def count_tensors(obj: Any) -> int:
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return 1
    if isinstance(obj, msgspec.Struct):
        return sum(count_tensors(getattr(obj, f)) for f in obj.__struct_fields__)
    if isinstance(obj, (list, tuple)):
        return sum(map(count_tensors, obj))
    if isinstance(obj, dict):
        return sum(map(count_tensors, obj.values()))
    return 0


# ---------------------------------------------------------------- round-trips


def test_strategies_cover_every_message_type() -> None:
    assert set(MESSAGES) == set(MESSAGE_TYPES)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, st.booleans())
def test_roundtrip_every_message(msg: Message, copy: bool) -> None:
    frames = codec.encode(msg)
    assert len(frames) == 1 + count_tensors(msg)
    assert_same(msg, codec.decode(frames, copy=copy))
    as_bytes = [bytes(f) for f in frames]  # as a socket delivers them
    assert_same(msg, codec.decode(as_bytes, copy=copy))
    assert codec.encoded_size(frames) == sum(map(len, as_bytes))
    if isinstance(msg, Delta) and not count_tensors(msg):
        _check_delta_header(msg, bytes(frames[0]))


def _check_delta_header(msg: Delta, frame: bytes) -> None:
    """Frame 0 is msgspec's encoding with the body's map header shortened (SPEC §6.2),
    and a receiver also takes msgspec's own longer header (any map header)."""
    plain, body = msgspec.msgpack.encode(msg), msgspec.msgpack.encode(msg.body)
    assert_same(msg, codec.decode([plain]))
    entries = len(msgspec.msgpack.decode(body))
    if entries > 15 or len(plain) > codec.COMPACT_LIMIT:
        assert frame == plain
        return
    assert body[:3] == bytes((0xDE, 0, entries))  # msgspec: map16 for DeltaBody
    assert frame == plain[:-len(body)] + bytes((0x80 | entries,)) + body[3:]


@given(st.integers(0, (1 << 64) - 1), st.integers(0, (1 << 64) - 1),
       st.integers(0, (1 << 64) - 1))
def test_the_steady_delta_shortcut_writes_the_general_bytes(epoch: int, seq: int,
                                                           digest: int) -> None:
    """The steady Delta (the shared empty body) is written without encoding the struct:
    the same bytes as the general path, which decode back to it."""
    msg = Delta(epoch, seq, digest, STEADY_BODY)
    frames = codec.encode(msg)
    assert len(frames) == 1
    _check_delta_header(msg, bytes(frames[0]))
    assert_same(msg, codec.decode(frames))


_PLAIN_VALUES = {k: v for k, v in _DELTA_VALUES.items() if k in codec.PLAIN_BODY_FIELDS}
plain_bodies = st.fixed_dictionaries({}, optional=_PLAIN_VALUES).map(lambda f: DeltaBody(**f))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.builds(Delta, ints, ints, digest=u64, body=plain_bodies | delta_bodies),
       st.booleans())
def test_the_plain_view_reads_plain_deltas_and_nothing_else(msg: Delta, compact: bool) -> None:
    """decode_plain reads the frame of a Delta that sets no body field but the plain
    ones (under either map header) as decode does, and refuses every other frame:
    the worker's plain step may only ever see a body that is plain."""
    frames = codec.encode(msg)
    frame = bytes(frames[0]) if compact or len(frames) > 1 else msgspec.msgpack.encode(msg)
    view = codec.decode_plain(frame)
    default = DeltaBody()
    plain = all(getattr(msg.body, f) == getattr(default, f) for f in DeltaBody.__struct_fields__
                if f not in codec.PLAIN_BODY_FIELDS)
    if not plain or len(frames) != 1 or len(frame) > codec.PLAIN_FRAME_LIMIT:
        assert view is None
        return
    assert view is not None
    assert (view.epoch, view.seq, view.digest) == (msg.epoch, msg.seq, msg.digest)
    for f in codec.PLAIN_BODY_FIELDS:
        assert getattr(view.body, f) == getattr(msg.body, f)


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_the_plain_view_of_random_bytes_is_none_or_a_plain_delta(frame: bytes) -> None:
    view = codec.decode_plain(frame)
    assert view is None or isinstance(view, codec.PlainDelta)
    assert codec.decode_plain(memoryview(frame)) is None  # bytes only


ZOO: dict[str, Any] = {
    "bf16": lambda: torch.tensor([1.5, -2.0, float("nan")], dtype=torch.bfloat16),
    "scalar_0d": lambda: torch.tensor(3.25),
    "empty": lambda: torch.empty(0, 3),
    "transposed": lambda: torch.arange(12.0).reshape(3, 4).t(),
    "np_fortran": lambda: np.asfortranarray(np.arange(6.0).reshape(2, 3)),
    "np_0d": lambda: np.array(7, np.int32),
    "np_sliced": lambda: np.arange(30, dtype=np.int16)[::3],
}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_in_prompt_embeds_and_mm_data(name: str) -> None:
    t = ZOO[name]()
    feature = MMFeatureRef("image", "img0", 0, 4, data={"pixels": [t, t], "x": None}, is_embed=t)
    add = NewRequest(handle=0, req_id="a", prompt_none=True, prompt_embeds=t,
                     mm_features=(feature,))
    for msg in (Delta(1, 1, 0, DeltaBody(added=(add,))), Snapshot(1, 1, 0,
                                                                  SnapshotBody(requests=(add,)))):
        frames = codec.encode(msg)
        assert len(frames) == 1 + 4
        for copy in (False, True):
            assert_same(msg, codec.decode(frames, copy=copy))


# ---------------------------------------------------------------- buffer lifetime


_ENDPOINTS = itertools.count()


@pytest.fixture()
def pair() -> Any:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    endpoint = f"inproc://test-codec-{next(_ENDPOINTS)}"  # zmq unbinds asynchronously
    push.bind(endpoint)
    pull.connect(endpoint)
    yield push, pull
    push.close(linger=0)
    pull.close(linger=0)


def _embeds_message(t: torch.Tensor) -> Snapshot:
    return Snapshot(1, 1, 0, SnapshotBody(requests=(NewRequest(0, "a", prompt_embeds=t),)))


def _embeds(frames: list[Any], copy: bool) -> Any:
    msg = codec.decode(frames, copy=copy)
    assert isinstance(msg, Snapshot)
    return msg.body.requests[0].prompt_embeds


BIG = 1 << 15  # 128 KiB of float32: above pyzmq's copy threshold, so really zero-copy


def test_mutation_after_tracker_never_reaches_the_receiver(pair: Any) -> None:
    push, pull = pair
    t = torch.arange(BIG, dtype=torch.float32)
    tracker = push.send_multipart(codec.encode(_embeds_message(t)), copy=False, track=True)
    received = pull.recv_multipart(copy=False)
    assert not tracker.done  # over inproc the receiver holds the sender's buffer
    decoded = _embeds(received, copy=True)
    del received
    gc.collect()
    tracker.wait(timeout=10)
    t.fill_(-1.0)  # allowed now: nothing references the sent memory
    assert tensors_equal(decoded, torch.arange(BIG, dtype=torch.float32))


def test_copy_true_is_independent_of_the_received_buffers(pair: Any) -> None:
    push, pull = pair
    t = torch.arange(BIG, dtype=torch.float32)
    tracker = push.send_multipart(codec.encode(_embeds_message(t)), copy=False, track=True)
    received = pull.recv_multipart(copy=False)
    copied = _embeds(received, copy=True)
    aliased = _embeds(received, copy=False)
    t[0] = 99.0  # breaks the rule: the buffers are still in flight
    assert aliased[0].item() == 99.0  # why the rule exists: copy=False shares the memory
    assert copied[0].item() == 0.0
    del received, aliased
    gc.collect()
    tracker.wait(timeout=10)


# ---------------------------------------------------------------- sparse sampling params


@pytest.mark.parametrize(
    ("spec", "size"),
    [
        (SamplingSpec(), 3),
        (SamplingSpec(temperature=0.0), 14),
        (SamplingSpec(max_tokens=256), 9),
        (SamplingSpec(seed=1234), 8),
        (SamplingSpec(temperature=0.7, top_p=0.95, max_tokens=512), 32),
    ],
)
def test_sampling_costs_only_non_default_fields(spec: SamplingSpec, size: int) -> None:
    assert len(msgspec.msgpack.encode(spec)) == size
    add = NewRequest(handle=0, req_id="r")
    with_spec = NewRequest(handle=0, req_id="r", sampling=spec)
    extra = len(msgspec.msgpack.encode(with_spec)) - len(msgspec.msgpack.encode(add))
    assert extra == size + 2  # the field key "s"


def test_float_defaults_made_elsewhere_are_omitted() -> None:
    # float("1") is equal to, but not the same object as, the field default 1.0.
    made_elsewhere = SamplingSpec(top_p=float("1"), repetition_penalty=float("1"),
                                  min_p=float("0"), presence_penalty=float("0"))
    assert msgspec.msgpack.encode(made_elsewhere) == msgspec.msgpack.encode(SamplingSpec())
    signed = SamplingSpec(min_p=-0.0)  # -0.0 == 0.0 but is a different value
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(signed), type=SamplingSpec)
    assert str(decoded.min_p) == "-0.0"


# ---------------------------------------------------------------- malformed input


def _rich_message() -> Delta:
    feature = MMFeatureRef("image", "i", 0, 2, data={"px": torch.ones(40)})
    add = NewRequest(handle=3, req_id="x", prompt=pack_uints([5, 6, 7]),
                     sampling=SamplingSpec(seed=1), mm_features=(feature,),
                     prompt_embeds=np.ones((2, 3), np.float32))
    return Delta(1, 9, 2**63 + 5, DeltaBody(added=(add,), finished=pack_uints([1, 2])))


def _decodes_or_malformed(frames: list[Any]) -> Any:
    try:
        return codec.decode(frames)
    except MalformedMessage:
        return None


@settings(max_examples=300)
@given(st.binary(max_size=64), st.lists(st.binary(max_size=16), max_size=3))
def test_random_bytes(body: bytes, extra: list[bytes]) -> None:
    _decodes_or_malformed([body, *extra])


def test_every_truncation_is_malformed() -> None:
    frames = [bytes(f) for f in codec.encode(_rich_message())]
    for cut in range(len(frames[0])):
        with pytest.raises(MalformedMessage):
            codec.decode([frames[0][:cut], *frames[1:]])
    for i in range(1, len(frames)):
        short = [*frames[:i], frames[i][:-1], *frames[i + 1 :]]
        with pytest.raises(MalformedMessage):
            codec.decode(short)


def test_missing_and_extra_tensor_frames_are_malformed() -> None:
    frames = [bytes(f) for f in codec.encode(_rich_message())]
    assert len(frames) == 3
    for bad in (frames[:1], frames[:2], [*frames, frames[1]], [*frames, b""]):
        with pytest.raises(MalformedMessage):
            codec.decode(bad)
    with pytest.raises(MalformedMessage):
        codec.decode([])
    with pytest.raises(MalformedMessage):
        codec.decode(codec.encode(Heartbeat(1, 2)) + [b"\0" * 8])


@settings(max_examples=120, suppress_health_check=[HealthCheck.too_slow])
@given(any_message, st.data())
def test_mutated_frames_decode_or_are_malformed(msg: Message, data: st.DataObject) -> None:
    frames = [bytearray(f) for f in codec.encode(msg)]
    for _ in range(data.draw(st.integers(1, 4), label="mutations")):
        i = data.draw(st.integers(0, len(frames) - 1), label="frame")
        if not frames[i]:
            continue
        pos = data.draw(st.integers(0, len(frames[i]) - 1), label="pos")
        frames[i][pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    _decodes_or_malformed([bytes(f) for f in frames])


# ---------------------------------------------------------------- mutated deltas vs a replica


def _spec(i: int) -> RequestSpec:
    prompt = np.arange(i, i + 8 + 3 * i, dtype=np.int64)
    prompt.flags.writeable = False
    return RequestSpec(f"req-{i}", prompt, SamplingSpec(temperature=0.5, seed=i))


def _request(live: list[int], computed: dict[int, int], blocks: dict[int, list[int]],
             finished: tuple[int, ...] = ()) -> ExecuteModelRequest:
    return ExecuteModelRequest(
        req_ids=[f"req-{i}" for i in live], specs=[_spec(i) for i in live],
        num_scheduled_tokens=np.array([2 if i % 3 else 1 for i in live], dtype=np.int64),
        num_computed_tokens=np.array([computed[i] for i in live], dtype=np.int64),
        block_tables=(Ragged.from_lists([blocks[i] for i in live]),),
        spec_token_ids=Ragged.empty(len(live)), encoder_inputs=Ragged.empty(len(live)),
        finished_req_ids=frozenset(f"req-{i}" for i in finished),
    )


@functools.cache
def _world() -> tuple[Snapshot, Delta, ExecuteModelRequest]:
    """(snapshot at seq 2, the delta 3 that follows, the engine's step-3 request)."""
    mirror = EngineMirror(verify=True)
    blocks = {i: [10 * i, 10 * i + 1] for i in range(8)}
    mirror.diff(_request([0, 1, 2, 3, 4], dict.fromkeys(range(8), 0), blocks))
    mirror.diff(_request([0, 1, 2, 3, 4], {i: 5 for i in range(8)}, blocks))
    snap = mirror.snapshot()
    blocks |= {1: [11, 12, 99], 4: [7], 5: [50, 51]}
    truth = _request([1, 4, 3, 5, 6], {1: 7, 3: 9, 4: 0, 5: 3, 6: 0}, blocks, finished=(0, 2))
    return snap, mirror.diff(truth), truth


def _synced(snap: Snapshot) -> WorkerReplica:
    replica = WorkerReplica()
    replica.receive(snap, 0.0)
    assert replica.state is State.SYNCED
    return replica


def _flips(size: int, header: int = 14) -> list[tuple[int, int]]:
    """Every bit of the header (tag, epoch, seq, digest), two rotating bits of each later byte."""
    every = [(pos, bit) for pos in range(min(header, size)) for bit in range(8)]
    return every + [(pos, (3 * pos + k) % 8) for pos in range(header, size) for k in (0, 4)]


def test_bit_flips_of_a_delta_are_rejected_or_exact() -> None:
    snap, delta, truth = _world()
    body = bytes(codec.encode(delta)[0])
    before = _synced(snap).data.rebuild()  # type: ignore[union-attr]
    outcomes: dict[str, int] = {}
    for pos, bit in _flips(len(body)):
        mutated = bytearray(body)
        mutated[pos] ^= 1 << bit
        outcome = _feed_mutated(snap, bytes(mutated), before, truth, delta.digest)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    # measured: most flips break msgpack or fail the digest/validity check; a few are
    # semantically neutral (e.g. inside a float that encodes the same spec) and apply exactly
    assert outcomes["RejectedDelta"] > outcomes.get("Applied", 0) * 10
    assert {"Malformed", "EpochChanged", "GapDetected", "Discarded"} <= set(outcomes)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))
def test_mutated_deltas_never_leave_a_wrong_state(edits: list[tuple[int, int]]) -> None:
    snap, delta, truth = _world()
    mutated = bytearray(codec.encode(delta)[0])
    for pos, value in edits:
        mutated[pos % len(mutated)] = value
    before = _synced(snap).data.rebuild()  # type: ignore[union-attr]
    _feed_mutated(snap, bytes(mutated), before, truth, delta.digest)


def _feed_mutated(snap: Snapshot, body: bytes, before: ExecuteModelRequest,
                  truth: ExecuteModelRequest, truth_digest: int) -> str:
    try:
        msg = codec.decode([body])
    except MalformedMessage:
        return "Malformed"
    replica = _synced(snap)
    try:
        events = replica.receive(msg, 1.0)
    except MalformedMessage:
        return "Malformed"
    data = replica.data
    assert data is not None and data.digest == data.recompute_digest()
    if any(isinstance(e, ev.Applied) for e in events):
        assert data.digest == truth_digest
        assert requests_equal(replica.request(), truth)
        return "Applied"
    assert data.digest == snap.digest
    assert requests_equal(data.rebuild(), before)
    kinds = {type(e) for e in events}
    if isinstance(msg, Delta):
        assert kinds & {ev.RejectedDelta, ev.Discarded, ev.GapDetected, ev.EpochChanged}, events
    return type(events[0]).__name__ if events else type(msg).__name__
