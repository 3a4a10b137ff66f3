"""vLLM adapter: mm_features with data and prompt_embeds, through frames and the store.

Generated SchedulerOutput streams (V1 and V2 shapes, tests/vllm_streams.py) get
multimodal items drawn from the tensor zoo (bf16, 0-d, empty, non-contiguous,
nested lists / tuples, every field class) and prompt embeddings, then travel
encoder → frames → decoder either inline (remote channel) or through a
shared-memory store (local channel).  Every step must come back strictly equal
(tests/vllm_equal.py).  Skipped cleanly when vLLM is not installed.
"""

from __future__ import annotations

import copy
import os
import zlib
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import msgspec
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalBatchedField,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm_equal import assert_vllm_equal  # noqa: E402
from vllm_streams import scheduler_streams  # noqa: E402

from engine_side.shm_store import ShmStore  # noqa: E402
from engine_side.vllm import SchedulerOutputEncoder  # noqa: E402
from engine_side.vllm.mm import UnsupportedItem, content_key  # noqa: E402
from protocol import codec  # noqa: E402
from protocol.errors import InvalidDelta, MalformedMessage  # noqa: E402
from protocol.items import StoreRef, as_store_ref  # noqa: E402
from protocol.messages import Delta, DeltaBody  # noqa: E402
from protocol.store_handles import ForgedHandle, StaleHandle  # noqa: E402
from worker_side.shm_reader import ShmReader  # noqa: E402
from worker_side.vllm import SchedulerOutputDecoder  # noqa: E402

pytestmark = pytest.mark.vllm
SECRET = b"k" * 32
POOL = 3  # distinct identifiers in a generated stream: requests share items


# ---------------------------------------------------------------- the tensor zoo


@st.composite
def tensors(draw: Any) -> Any:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kind = draw(st.sampled_from(["f32", "bf16", "i64", "bool", "empty", "0d", "strided"]))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    if kind == "f32":
        return torch.randn(shape, generator=g)
    if kind == "bf16":
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    if kind == "i64":
        return torch.randint(-9, 9, shape, generator=g)
    if kind == "bool":
        return torch.rand(shape, generator=g) > 0.5
    if kind == "empty":
        return torch.empty((0, *shape))
    if kind == "0d":
        return torch.tensor(draw(st.floats(-4, 4)))
    return torch.randn((*shape, 3), generator=g).transpose(0, -1)  # non-contiguous


nested = st.recursive(
    tensors() | st.integers(-5, 5) | st.floats(-2, 2),
    lambda inner: st.lists(inner, max_size=3) | st.tuples(inner, inner), max_leaves=6)
slice_ = st.builds(slice, st.none() | st.integers(0, 4), st.none() | st.integers(0, 9),
                   st.none() | st.just(1))
fields = st.one_of(
    st.builds(MultiModalBatchedField, keep_on_cpu=st.booleans()),
    st.builds(MultiModalFlatField, keep_on_cpu=st.booleans(), dim=st.integers(-1, 1),
              slices=st.lists(slice_, max_size=3) | st.tuples(slice_)
              | st.lists(st.lists(slice_, max_size=2), min_size=1, max_size=2)),
    st.builds(MultiModalSharedField, keep_on_cpu=st.booleans(), batch_size=st.integers(1, 3)))


@st.composite
def mm_items(draw: Any) -> Any:
    keys = draw(st.lists(st.sampled_from(["pixel_values", "image_grid_thw", "a", "b"]),
                         min_size=1, max_size=3, unique=True))
    return MultiModalKwargsItem({k: MultiModalFieldElem(draw(st.none() | nested), draw(fields))
                                 for k in keys})


def _crc(text: str) -> int:
    return zlib.crc32(text.encode())


def with_items(stream: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """The stream with feature data and prompt embeds, one content per identifier / id."""
    items: dict[str, Any] = {}
    embeds: dict[str, Any] = {}
    for k, so in enumerate(stream["steps"]):
        for nr in so.scheduled_new_reqs:
            if nr.mm_features:
                n = 1 + _crc(nr.req_id) % 2
                idents = [f"img{(_crc(nr.req_id) + j) % POOL}" for j in range(n)]
                for ident in idents:
                    if ident not in items:
                        items[ident] = data.draw(mm_items())
                nr.mm_features = [MultiModalFeatureSpec(
                    items[ident], "image", ident,
                    PlaceholderRange(j, 2, torch.tensor([True, j == 0])), ident)
                    for j, ident in enumerate(idents)]
            if _crc(nr.req_id) % 4 == 0:
                if nr.req_id not in embeds:
                    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
                    embeds[nr.req_id] = torch.randn(len(nr.prompt_token_ids), 8).to(dtype)
                nr.prompt_embeds = embeds[nr.req_id]
        so.free_encoder_mm_hashes = [f"img{k % POOL}" for _ in so.free_encoder_mm_hashes]
    return stream


# ---------------------------------------------------------------- channels


def _wire(frames: list[Any]) -> list[bytes]:
    return [bytes(f) for f in frames]


class Local:
    """Encoder with a store, decoder with a reader attached to it (one process)."""

    def __init__(self, kv_groups: int | None = None, capacity: int = 1 << 24) -> None:
        self.store = ShmStore(capacity)
        self.reader = ShmReader.attach(self.store.add_reader(os.getpid()))
        self.enc = SchedulerOutputEncoder(kv_groups, secret=SECRET, store=self.store)
        self.dec = SchedulerOutputDecoder(secret=SECRET)
        self.dec.attach_store(self.reader)

    def close(self) -> None:
        self.reader.close()
        self.store.close()

    def check_lifetimes(self) -> None:
        """Both ends agree on every count; the reader holds exactly the counted items."""
        assert self.enc.items is not None and self.dec.items is not None
        engine = self.enc.items
        assert engine.counts == self.dec.items.counts
        assert set(self.reader.held_keys) == {engine.key_of(i) for i in engine.counts}
        assert set(self.dec.items.held.values()) == set(self.reader.held_keys)


@pytest.fixture
def local() -> Iterator[Local]:
    pair = Local(kv_groups=1)
    yield pair
    pair.close()


def _scramble(got: Any) -> None:
    """What vLLM does to what it is handed (the decoder's state must not see it)."""
    for nr in got.scheduled_new_reqs:
        for f in nr.mm_features:
            f.data = None  # WorkerWrapperBase._apply_mm_cache rewrites in place
        nr.mm_features.clear()
        for ids in nr.block_ids:
            ids.append(-5)


@settings(max_examples=25, deadline=None)
@given(stream=scheduler_streams(max_steps=8), data=st.data())
def test_streams_with_items_round_trip_through_frames(stream: dict[str, Any],
                                                      data: st.DataObject) -> None:
    stream = with_items(stream, data)
    enc = SchedulerOutputEncoder(stream["kv_groups"], secret=SECRET)
    dec = SchedulerOutputDecoder(secret=SECRET)
    for so in stream["steps"]:
        expected = copy.deepcopy(so)
        got = dec.decode(_wire(enc.encode(so)))
        assert_vllm_equal(expected, got)
        _scramble(got)


def _forged_copy(frames: list[bytes], pick: int) -> list[bytes] | None:
    """The step with the handle of one of its store references (the ``pick``-th, mod
    their number) forged; None if it has none."""
    delta = codec.decode(frames)
    assert isinstance(delta, Delta) and isinstance(delta.body, DeltaBody)
    spots = [(k, j) for k, new in enumerate(delta.body.added)
             for j, d in enumerate(new.mm_data) if type(d) is dict and d.get("h")]
    if not spots:
        return None
    k, j = spots[pick % len(spots)]
    new = delta.body.added[k]
    data = list(new.mm_data)
    data[j] = _forge(data[j])
    added = list(delta.body.added)
    added[k] = msgspec.structs.replace(new, mm_data=tuple(data))
    body = msgspec.structs.replace(delta.body, added=tuple(added))
    return _wire(codec.encode(msgspec.structs.replace(delta, body=body)))


@settings(max_examples=25, deadline=None)
@given(stream=scheduler_streams(max_steps=8), data=st.data())
def test_streams_with_items_round_trip_through_the_store(stream: dict[str, Any],
                                                         data: st.DataObject) -> None:
    """Every step comes back equal with both ends agreeing on every item count; a copy
    of a step with one reference forged, decoded first, is refused with the rank's
    seq, counts and held items as they were."""
    stream = with_items(stream, data)
    pair = Local(stream["kv_groups"])
    assert pair.dec.items is not None
    try:
        for so in stream["steps"]:
            expected = copy.deepcopy(so)
            frames = _wire(pair.enc.encode(so))
            assert len(frames) <= 1 + sum(f.mm_position.is_embed is not None
                                          for nr in so.scheduled_new_reqs
                                          for f in nr.mm_features)  # only is_embed masks
            forged = _forged_copy(frames, data.draw(st.integers(0, 7))) \
                if data.draw(st.booleans()) else None
            if forged is not None:
                before = (pair.dec.seq, pair.dec.items.counts, sorted(pair.reader.held_keys))
                with pytest.raises(ForgedHandle):
                    pair.dec.decode(forged)
                assert (pair.dec.seq, pair.dec.items.counts,
                        sorted(pair.reader.held_keys)) == before
            got = pair.dec.decode(frames)
            assert_vllm_equal(expected, got)
            pair.check_lifetimes()
            _scramble(got)
    finally:
        pair.close()


# ---------------------------------------------------------------- scenarios


def image(seed: int, side: int = 64) -> Any:
    g = torch.Generator().manual_seed(seed)
    return MultiModalKwargsItem({
        "pixel_values": MultiModalFieldElem(torch.randn(3, side, side, generator=g),
                                            MultiModalBatchedField()),
        "image_grid_thw": MultiModalFieldElem(torch.tensor([1, 4, 4]), MultiModalBatchedField())})


def new_req(rid: str, items: list[tuple[str, Any]], embeds: Any = None) -> Any:
    features = [MultiModalFeatureSpec(item, "image", ident, PlaceholderRange(2 * j, 2), ident)
                for j, (ident, item) in enumerate(items)]
    return NewRequestData(rid, [1, 2, 3, 4, 5, 6, 7, 8], features, SamplingParams(), None, ([1],),
                          0, None, prompt_embeds=embeds)


def step(new: Sequence[Any] = (), running: Sequence[str] = (),
         finished: AbstractSet[str] = frozenset(), encode: dict[str, list[int]] | None = None,
         free: Sequence[str] = ()) -> Any:
    cached = CachedRequestData(list(running), set(), [], {}, [None] * len(running),
                               [8] * len(running), [1] * len(running))
    sched = {**{nr.req_id: 8 for nr in new}, **dict.fromkeys(running, 1)}
    return SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached, num_scheduled_tokens=sched,
        total_num_scheduled_tokens=sum(sched.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs=encode or {}, num_common_prefix_blocks=[],
        finished_req_ids=set(finished), free_encoder_mm_hashes=list(free))


def send(pair: Local, so: Any) -> tuple[list[bytes], Any]:
    expected = copy.deepcopy(so)
    frames = _wire(pair.enc.encode(so))
    got = pair.dec.decode(frames)
    assert_vllm_equal(expected, got)
    return frames, got


def feature_data(frames: list[bytes]) -> list[Any]:
    delta = codec.decode(frames)
    assert isinstance(delta, Delta) and isinstance(delta.body, DeltaBody)
    return [d for a in delta.body.added for d in a.mm_data]


def test_store_hit_sends_only_the_key(local: Local) -> None:
    x = image(1)  # 49 kB of pixels
    frames, got = send(local, step([new_req("a", [("X", x)])], encode={"a": [0]}))
    assert len(frames) == 1 and sum(map(len, frames)) < 1000
    assert local.enc.items is not None
    assert local.enc.items.stats.written == 1
    pixels = got.scheduled_new_reqs[0].mm_features[0].data["pixel_values"].data
    assert pixels.data_ptr() != x["pixel_values"].data.data_ptr()  # zero-copy from the store:
    base = torch.frombuffer(local.reader._data, dtype=torch.uint8).data_ptr()  # test-only peek
    assert base <= pixels.data_ptr() < base + local.reader.info.capacity
    frames, _ = send(local, step([new_req("b", [("X", image(1))])], running=["a"]))
    ref = as_store_ref(feature_data(frames)[0])
    assert ref == StoreRef()  # no handle: the worker holds it
    assert len(msgspec.msgpack.encode(ref)) <= 10
    assert local.enc.items.stats.written == 1 and local.enc.items.stats.hits == 1
    remote = SchedulerOutputEncoder(1, secret=SECRET)
    inline = _wire(remote.encode(step([new_req("b", [("X", image(1))])])))
    assert sum(map(len, inline)) > 49_000  # the same step without a store


def test_item_freed_after_last_request_and_encoder_cache(local: Local) -> None:
    engine_counts = lambda: local.enc.items.counts  # type: ignore[union-attr]  # noqa: E731
    send(local, step([new_req("a", [("X", image(1))]), new_req("b", [("X", image(1))])],
                     encode={"a": [0]}))
    assert engine_counts() == {"X": 3} and local.reader.holds("X")  # 2 requests + cache
    send(local, step(running=["b"], finished={"a"}))
    send(local, step(finished={"b"}))
    assert engine_counts() == {"X": 1} and local.reader.holds("X")  # encoder cache only
    send(local, step(free=["X"]))
    assert engine_counts() == {} and not local.reader.holds("X")
    assert local.store._entries["X"].refs == 0  # evictable now (test-only peek)
    local.check_lifetimes()


def test_prompt_embeds_travel_by_content_key(local: Local) -> None:
    embeds = torch.randn(8, 32).to(torch.bfloat16)
    frames, got = send(local, step([new_req("a", [], embeds)]))
    assert len(frames) == 1 and sum(map(len, frames)) < 1000  # 512 B of embeds, not inline
    assert local.reader.holds(content_key(embeds))
    _, got2 = send(local, step([new_req("b", [], embeds.clone())], running=["a"]))
    assert got2.scheduled_new_reqs[0].prompt_embeds is not got.scheduled_new_reqs[0].prompt_embeds
    send(local, step(finished={"a", "b"}))
    assert not local.reader.holds(content_key(embeds))


def test_stored_embeds_beside_items_sent_without_data(local: Local) -> None:
    """A request whose items travel without data (``mm_data`` empty: vLLM's features
    then have none) and whose prompt embeds are stored resolves its embeds (a
    ValueError, untyped, where the items were zipped with no data)."""
    embeds = torch.randn(8, 32)
    frames = _wire(local.enc.encode(step([new_req("a", [("X", image(1))], embeds)])))
    delta = codec.decode(frames)
    assert isinstance(delta, Delta) and isinstance(delta.body, DeltaBody)
    added = msgspec.structs.replace(delta.body.added[0], mm_data=())
    body = msgspec.structs.replace(delta.body, added=(added,))
    got = local.dec.decode(_wire(codec.encode(msgspec.structs.replace(delta, body=body))))
    new = got.scheduled_new_reqs[0]
    assert [f.data for f in new.mm_features] == [None]
    assert torch.equal(new.prompt_embeds, embeds)
    assert local.reader.holds(content_key(embeds)) and not local.reader.holds("X")


def test_copy_gives_writable_private_tensors() -> None:
    enc = SchedulerOutputEncoder(1, secret=SECRET)
    dec = SchedulerOutputDecoder(secret=SECRET, copy=True)
    x = image(3, side=8)
    got = dec.decode(_wire(enc.encode(step([new_req("a", [("X", x)], torch.ones(8, 4))]))))
    nr = got.scheduled_new_reqs[0]
    nr.mm_features[0].data["pixel_values"].data.zero_()
    nr.prompt_embeds.zero_()
    assert dec.state is not None
    held = dec.state.requests[0]  # what the decoder's state keeps
    assert held is not None and float(held.embeds.sum()) == 32.0
    assert torch.equal(held.mm_data[0]["i"][0][1], x["pixel_values"].data)


def _tamper(frames: list[bytes], edit: Any) -> list[bytes]:
    delta = codec.decode(frames)
    assert isinstance(delta, Delta) and isinstance(delta.body, DeltaBody)
    added = delta.body.added[0]
    added = msgspec.structs.replace(added, mm_data=(edit(added.mm_data[0]),
                                                    *added.mm_data[1:]))
    body = msgspec.structs.replace(delta.body, added=(added, *delta.body.added[1:]))
    return _wire(codec.encode(msgspec.structs.replace(delta, body=body)))


def _forge(data: dict[str, Any]) -> dict[str, Any]:
    handle = data["h"][0]
    return {**data, "h": {0: [handle[0], handle[1], handle[2], bytes(16)]}}


def _regenerate(data: dict[str, Any]) -> dict[str, Any]:
    return {**data, "h": {0: [data["h"][0][0], data["h"][0][1], 999, data["h"][0][3]]}}


@pytest.mark.parametrize(("edit", "error"), [(_forge, ForgedHandle), (_regenerate, ForgedHandle)])
@pytest.mark.parametrize("at", [0, 1])
def test_forged_handle_is_refused_before_the_state_changes(local: Local, edit: Any, error: type,
                                                          at: int) -> None:
    """A reference that does not resolve (the first or second of a request's items)
    refuses the step with the rank's state and the reader's holds as they were, so the
    genuine step then applies (references resolved after the state had moved on, and an
    item resolved before the bad one stayed held)."""
    so = step([new_req("a", [("X", image(1)), ("Y", image(2))])])
    expected = copy.deepcopy(so)
    frames = _wire(local.enc.encode(so))
    delta = codec.decode(frames)
    assert isinstance(delta, Delta) and isinstance(delta.body, DeltaBody)
    added = delta.body.added[0]
    data = list(added.mm_data)
    data[at] = edit(data[at])
    body = msgspec.structs.replace(delta.body, added=(msgspec.structs.replace(
        added, mm_data=tuple(data)),))
    with pytest.raises(error):
        local.dec.decode(_wire(codec.encode(msgspec.structs.replace(delta, body=body))))
    assert local.dec.seq == 0 and local.dec.state is None
    assert not local.reader.holds("X") and not local.reader.holds("Y")
    assert local.dec.items is not None and local.dec.items.counts == {}
    assert_vllm_equal(expected, local.dec.decode(frames))
    assert local.reader.holds("X") and local.reader.holds("Y")
    assert local.dec.items.counts == {"X": 1, "Y": 1}


def test_stale_handle_is_refused(local: Local) -> None:
    """A genuine handle whose item was released (and evicted) since it was issued."""
    first = _wire(local.enc.encode(step([new_req("a", [("X", image(1))])])))
    local.dec.decode(first)
    send(local, step(finished={"a"}))
    assert not local.reader.holds("X")
    replay = SchedulerOutputDecoder(secret=SECRET)
    replay.attach_store(local.reader)
    with pytest.raises(StaleHandle):
        replay.decode(first)
    assert replay.seq == 0 and replay.state is None


def test_unsupported_item_is_refused_before_sending() -> None:
    enc = SchedulerOutputEncoder(1, secret=SECRET)
    bad = MultiModalKwargsItem({"x": MultiModalFieldElem(
        "text", MultiModalBatchedField())})  # type: ignore[arg-type]  # deliberately no tensor
    with pytest.raises(UnsupportedItem):
        enc.encode(step([new_req("a", [("X", bad)])]))


@pytest.mark.parametrize("fault", ["index", "count"])
def test_a_failed_step_takes_back_its_store_references(local: Local, fault: str) -> None:
    """A step that fails after its items were written (a bad encoder input index: the
    lifetime plan refuses it; a negative scheduled count: the mirror does) leaves the
    store's references and the counts as they were."""
    from protocol.errors import LocalProtocolError

    so = step([new_req("a", [("X", image(1))])],
              encode={"a": [5]} if fault == "index" else None)
    if fault == "count":
        so.num_scheduled_tokens = {"a": -1}
    with pytest.raises(LocalProtocolError):
        local.enc.encode(so)
    assert local.enc.items is not None and local.enc.items.counts == {}
    assert local.store._entries["X"].refs == 0  # written, then given back (test-only peek)


def _deep(depth: int) -> Any:
    value: Any = None
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("edit", [
    lambda d: {**d, "i": [["pixel_values", _deep(600), ["b", False]]]},  # past the stack
    lambda d: {**d, "i": [["pixel_values", 1, ["no such field"]]]},
    lambda d: {**d, "i": [["pixel_values", "text", ["b", False]]]},
    lambda d: {**d, "i": [["pixel_values", {"T": 1}, ["b", False]]]},
    lambda d: {**d, "i": [["pixel_values", 1, ["f", False, [{"s": [1]}], 0]]]},
    lambda d: {"@": "store", "i": []},
    lambda d: [d],
])
def test_a_malformed_item_is_refused_before_the_state_changes(edit: Any) -> None:
    """Inline items (no store) are rebuilt while the step can still be refused: a bad
    one is MalformedMessage with the decoder as it was, and the genuine step then
    decodes (it was rebuilt after the state had moved on, and nesting raised
    RecursionError)."""
    enc = SchedulerOutputEncoder(1, secret=SECRET)
    dec = SchedulerOutputDecoder(secret=SECRET)
    so = step([new_req("a", [("X", image(1, side=8))])])
    expected = copy.deepcopy(so)
    frames = _wire(enc.encode(so))
    with pytest.raises(MalformedMessage):
        dec.decode(_tamper(frames, edit))
    assert dec.seq == 0 and dec.state is None
    assert_vllm_equal(expected, dec.decode(frames))


def test_a_malformed_embed_mask_is_refused_before_the_state_changes() -> None:
    enc = SchedulerOutputEncoder(1, secret=SECRET)
    dec = SchedulerOutputDecoder(secret=SECRET)
    so = step([new_req("a", [("X", image(1, side=8))], torch.ones(8, 4))])
    frames = _wire(enc.encode(so))
    delta = codec.decode(frames)
    assert isinstance(delta, Delta) and isinstance(delta.body, DeltaBody)
    for field, value in (("mm_embed", ("not a mask",)), ("embeds", "not a tensor")):
        added = msgspec.structs.replace(delta.body.added[0], **{field: value})
        body = msgspec.structs.replace(delta.body, added=(added,))
        with pytest.raises(MalformedMessage):
            dec.decode(_wire(codec.encode(msgspec.structs.replace(delta, body=body))))
        assert dec.seq == 0 and dec.state is None
    added = msgspec.structs.replace(delta.body.added[0], mm_embed=(None, None))  # 2 for 1
    body = msgspec.structs.replace(delta.body, added=(added,))
    with pytest.raises(InvalidDelta, match="masks must match"):
        dec.decode(_wire(codec.encode(msgspec.structs.replace(delta, body=body))))
    dec.decode(frames)
    assert dec.seq == 1


def test_an_item_nested_past_the_wire_forms_depth_is_refused_before_sending() -> None:
    enc = SchedulerOutputEncoder(1, secret=SECRET)
    deep = MultiModalKwargsItem({"x": MultiModalFieldElem(
        _deep(40), MultiModalBatchedField())})  # type: ignore[arg-type]
    with pytest.raises(UnsupportedItem, match="nested too deep"):
        enc.encode(step([new_req("a", [("X", deep)])]))
    assert enc.seq == 0
