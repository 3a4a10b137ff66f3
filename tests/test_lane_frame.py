"""The engine's one-call frame of a same-batch step with count or draft rows (``lane_frame``,
protocol/_speedups_frame.c) against codec.encode of the Delta the objects make: the
very bytes for every input it takes, both map headers of the body included, and a
refusal (None) for every input it does not."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from protocol import codec, speedups
from protocol.messages import Delta, DeltaBody, Rows

pytest.importorskip("vllm", reason="StepExt is the vLLM adapter's schema")
C: Any = speedups.C  # (the module skips without it)
pytestmark = pytest.mark.skipif(C is None, reason="C speedups not built")
U64 = (1 << 64) - 1

_bins = st.one_of(st.just(b""), st.binary(min_size=1, max_size=8),
                  st.binary(min_size=200, max_size=300))
_pair: Any = st.one_of(st.none(), st.tuples(st.just([]), st.just([]), _bins, _bins))
_triple: Any = st.one_of(st.none(), st.tuples(_bins, _bins, _bins))
_head = st.one_of(st.integers(0, 200), st.integers(0, U64))


def _step_ext(out_pos: bytes, out_delta: bytes) -> bytes:
    from engine_side.vllm.schema import StepExt  # (vLLM's adapter holds the schema)

    return codec._PLAIN_ENCODER.encode(StepExt(out_pos=out_pos, out_delta=out_delta))


def _reference(head: tuple[int, int, int], computed: Any, scheduled: Any, packed: Any,
               drafts: Any, outputs: Any, structured: bool, pending: bool, nspec: int,
               ) -> bytes:
    """The frame codec.encode writes for the Delta the documented mapping makes."""
    fields: dict[str, Any] = {}
    if computed is not None:
        fields["computed_tokens"] = Rows(handles=computed[2], values=computed[3])
    if scheduled is not None:
        fields["scheduled_tokens"] = Rows(handles=scheduled[2], values=scheduled[3])
    if packed is not None:
        fields["block_append"] = (Rows(*packed),)
    if drafts is not None:
        fields["spec_tokens"] = Rows(counts=drafts[2], values=drafts[3])
    if outputs is not None:
        fields["extension"] = {"v": _step_ext(outputs[2], outputs[3])}
    body = DeltaBody(**fields, has_structured_output=structured,
                     pending_structured_output=pending, num_spec_tokens_to_schedule=nspec)
    frames = codec.encode(Delta(*head, body))
    assert len(frames) == 1
    return bytes(frames[0])


@settings(max_examples=300, deadline=None)
@given(head=st.tuples(_head, _head, _head), computed=_pair, scheduled=_pair, packed=_triple,
       drafts=_pair, outputs=_pair, structured=st.booleans(), pending=st.booleans(),
       nspec=st.one_of(st.just(0), st.integers(0, U64)))
@example(head=(1, 2, 3), computed=([], [], b"\x01", b"\x02"), scheduled=None, packed=None,
         drafts=None, outputs=None, structured=False, pending=False, nspec=0)
@example(head=(U64, U64, U64), computed=([], [], b"a" * 300, b"b" * 300),
         scheduled=([], [], b"c" * 300, b"d" * 300), packed=(b"", b"", b"e" * 300),
         drafts=([], [], b"", b"f"), outputs=([], [], b"g" * 70000, b""), structured=True,
         pending=True, nspec=U64)
def test_lane_frame_writes_the_objects_bytes(head: tuple[int, int, int], computed: Any,
                                             scheduled: Any, packed: Any, drafts: Any,
                                             outputs: Any, structured: bool, pending: bool,
                                             nspec: int) -> None:
    """Every input it takes gives codec.encode's bytes, over both sides of
    COMPACT_LIMIT and bins of all three header widths."""
    got = C.lane_frame(*head, computed, scheduled, packed, drafts, outputs, structured,
                       pending, nspec)
    assert got == _reference(head, computed, scheduled, packed, drafts, outputs, structured,
                             pending, nspec)


def test_lane_frame_compacts_the_body_map_up_to_the_limit() -> None:
    """Frames of 1024 bytes and less get the fixmap header, longer ones keep msgspec's
    map16 (codec.COMPACT_LIMIT), as codec.encode writes them."""
    sizes = set()
    for n in range(980, 1010):
        rows: Any = ([], [], b"h" * n, b"v")
        got = C.lane_frame(1, 2, 3, rows, None, None, None, None, False, False, 0)
        assert got == _reference((1, 2, 3), rows, None, None, None, None, False, False, 0)
        sizes.add(len(got))
    assert {1021, 1022, 1025, 1026} <= sizes  # either side of the limit, its 2 bytes saved


_ROWS: Any = ([], [], b"\x01", b"\x02")


@pytest.mark.parametrize("args", [
    (-1, 1, 1, _ROWS, None, None, None, None, False, False, 0),  # a negative epoch
    (1, 1 << 64, 1, _ROWS, None, None, None, None, False, False, 0),  # seq past uint64
    (1, 1, 1.0, _ROWS, None, None, None, None, False, False, 0),  # a float digest
    (1, 1, 1, _ROWS, None, None, None, None, 1, False, 0),  # a flag that is not a bool
    (1, 1, 1, _ROWS, None, None, None, None, False, False, -4),  # a negative ns
    (1, 1, 1, ([], [], bytearray(b"x"), b""), None, None, None, None, False, False, 0),
    (1, 1, 1, ([], [], b"x"), None, None, None, None, False, False, 0),  # a short tuple
    (1, 1, 1, [[], [], b"x", b"y"], None, None, None, None, False, False, 0),  # a list
    (1, 1, 1, None, None, (b"", b""), None, None, False, False, 0),  # two Rows fields
    (1, 1, 1, None, None, None, None, ([], [], "op", b""), False, False, 0),  # a str
])
def test_lane_frame_refuses_what_it_does_not_take(args: tuple[Any, ...]) -> None:
    """None (the objects then decide) for ints out of [0, 2**64), flags that are not
    bools and fields that are not bytes in tuples of the scan's shapes."""
    assert C.lane_frame(*args) is None


def test_lane_frame_checks_its_argument_count() -> None:
    with pytest.raises(TypeError):
        C.lane_frame(1, 2, 3)


def _fields(body: DeltaBody, ext: Any) -> tuple[Any, ...]:
    """A body's fields in lane_view's order, its Rows as (handles, counts, values)."""
    def rows(r: Rows | None) -> Any:
        return None if r is None else (r.handles, r.counts, r.values)

    return (rows(body.computed_tokens), rows(body.scheduled_tokens), rows(body.spec_tokens),
            tuple(rows(r) for r in body.block_append), ext.out_pos, ext.out_delta,
            body.has_structured_output, body.pending_structured_output,
            body.num_spec_tokens_to_schedule)


def _decoded(frame: bytes) -> tuple[Any, ...] | None:
    """What the objects say of ``frame``: lane_view's answer when it is a Delta whose body
    has count, draft or output rows or a number of speculative tokens and nothing
    lane_view does not read, else None."""
    from worker_side.vllm.quick import frame_objects

    try:
        body, ext = frame_objects(frame)
        msg = codec.decode([frame])
    except Exception:  # noqa: BLE001 - any refusal: lane_view must not read it either
        return None
    assert isinstance(msg, Delta)
    reads = ("computed_tokens", "scheduled_tokens", "spec_tokens", "block_append",
             "has_structured_output", "pending_structured_output",
             "num_spec_tokens_to_schedule", "extension")
    rest = {f: getattr(body, f) for f in DeltaBody.__struct_fields__ if f not in reads}
    if rest != {f: getattr(DeltaBody(), f) for f in rest} or (
            body.computed_tokens is None and body.scheduled_tokens is None
            and body.spec_tokens is None and not ext.out_pos
            and not body.num_spec_tokens_to_schedule):
        return None
    return (msg.epoch, msg.seq, msg.digest, *_fields(body, ext))


@settings(max_examples=300, deadline=None)
@given(head=st.tuples(_head, _head, _head), computed=_pair, scheduled=_pair, packed=_triple,
       drafts=_pair, outputs=_pair, structured=st.booleans(), pending=st.booleans(),
       nspec=st.one_of(st.just(0), st.integers(0, U64)))
def test_lane_view_reads_what_lane_frame_writes(head: tuple[int, int, int], computed: Any,
                                               scheduled: Any, packed: Any, drafts: Any,
                                               outputs: Any, structured: bool, pending: bool,
                                               nspec: int) -> None:
    """The worker's read of every frame lane_frame writes with count, draft or output rows
    or a number of speculative tokens is the objects' (None for a frame without them:
    the other paths read those)."""
    frame = C.lane_frame(*head, computed, scheduled, packed, drafts, outputs, structured,
                         pending, nspec)
    expected = _decoded(frame)
    assert (expected is None) == (computed is None and scheduled is None and drafts is None
                                  and (outputs is None or not outputs[2]) and not nspec)
    assert C.lane_view(frame) == expected


@settings(max_examples=400, deadline=None)
@given(data=st.data(), computed=_pair, outputs=_pair, packed=_triple)
def test_lane_view_reads_any_frame_as_the_objects_or_not_at_all(
        data: st.DataObject, computed: Any, outputs: Any, packed: Any) -> None:
    """A frame cut short, extended or with a byte changed is read as the objects read it,
    or refused (None); nothing else, and never an exception."""
    frame = bytearray(C.lane_frame(1, 2, 3, computed or ([], [], b"\x01", b"\x02"), None,
                                   packed, None, outputs, False, True, 4))
    edit = data.draw(st.sampled_from(["cut", "extend", "change"]))
    if edit == "cut":
        del frame[data.draw(st.integers(0, len(frame) - 1)):]
    elif edit == "extend":
        frame += data.draw(st.binary(min_size=1, max_size=4))
    else:
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    got = C.lane_view(bytes(frame))
    assert got is None or got == _decoded(bytes(frame))


@pytest.mark.parametrize("frame", [
    b"", b"\x95", b"\x95\x04\x01\x02\x03", b"\x94\x04\x01\x02\x03\x80",
    b"\x95\x04\x01\x02\x03\x80",  # an empty body: no count or draft rows
    b"\x95\x04\x01\x02\x03\x81\xa2ba\x91\x80",  # appends alone: a plain step's
    b"\x95\x04\x01\x02\x03\x82\xa2ba\x91\x80\xa2so\xc3",  # appends and a flag
    b"\x95\x04\x01\x02\x03\x81\xa2ba\x91\xc4",  # appends cut short
    b"\x95\x04\x01\x02\x03\x81\xa2nc\x80\x00",  # a byte past the body
    b"\x95\x04\x01\x02\x03\x82\xa2nc\x80\xa2nc\x80",  # a key twice
    b"\x95\x04\x01\x02\x03\x82\xa2nc\x80\xa2nt\x80",  # keys out of field order
    b"\x95\x04\x01\x02\x03\x82\xa2nc\x80\xa2so\xc2",  # a false flag (not lane_frame's)
    b"\x95\x04\xff\x02\x03\x81\xa2nc\x80",  # a negative epoch
    b"\x95\x04\x01\x02\x03\x82\xa2nc\x80\xa1x\x81\xa1v\xc4\x02\x80\x00",  # a byte past the StepExt
    b"\x95\x04\x01\x02\x03\x82\xa2nc\x80\xa1x\x81\xa1v\xc4\x04\x81\xa2kg\x01",  # kv_groups
])
def test_lane_view_refuses_frames_lane_frame_does_not_write(frame: bytes) -> None:
    assert C.lane_view(frame) is None


def test_lane_view_takes_bytes_alone() -> None:
    frame = C.lane_frame(1, 2, 3, ([], [], b"\x01", b"\x02"), None, None, None, None, False,
                         False, 0)
    assert C.lane_view(frame) is not None
    assert C.lane_view(memoryview(frame)) is None
    assert C.lane_view(bytearray(frame)) is None
