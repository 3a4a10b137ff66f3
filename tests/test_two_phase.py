"""Two-phase application (SPEC §8.3): a body either applies whole or not at all.

For a random valid state (a core stream's steps applied through the codec) and a
mutated body -- the encoding of the next genuine step with bytes flipped, one field of
it replaced by a random value, or a random near-valid body --
``ReplicaState.apply`` either succeeds, the digest then equal to its from-scratch
recomputation, or raises a :class:`ProtocolError` (and nothing else) with the state
exactly as it was: digest and cached sums, schedule and counts, every handle column,
requests and specs, block tables and token histories.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from core_streams import core_streams, spec_of
from hypothesis import event, given, settings
from hypothesis import strategies as st
from oracle import state_fingerprint
from replica_bodies import first_step

from engine_side.mirror import EngineMirror, Entry
from protocol import codec
from protocol.errors import MalformedMessage, ProtocolError, RemoteProtocolError
from protocol.messages import (
    MAX_BLOCK_ID,
    TOKEN_MODE_ENGINE,
    TOKEN_MODE_WORKER,
    Delta,
    DeltaBody,
    NewRequest,
    RareBody,
    Rows,
    Spec,
    encode_spec,
)
from protocol.packing import pack_sints, pack_uints
from protocol.params import SamplingSpec
from protocol.rebuild import rebuild_request
from protocol.snapshot import build_snapshot, load_snapshot
from protocol.state import ReplicaState

#: values at the edges of every check: zero, small, int32 and int64 limits, past them
EDGES = [0, 1, 2, 3, 7, MAX_BLOCK_ID, MAX_BLOCK_ID + 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


def _packed(hi: int, max_size: int = 6) -> st.SearchStrategy[bytes]:
    """Packed lists of mostly small values (up to ``hi``), now and then an edge value."""
    value = st.integers(0, hi) | st.sampled_from(EDGES)
    return st.lists(value, max_size=max_size).map(pack_uints)


def _rows(n: int, hi: int, signed: bool = False) -> st.SearchStrategy[Rows]:
    """Rows keyed by positions near a schedule of ``n`` (absent keys: every position)."""
    values = (st.lists(st.integers(-5, 5) | st.sampled_from([-(1 << 63), (1 << 63) - 1]),
                       max_size=6).map(pack_sints) if signed else _packed(hi))
    return st.builds(Rows, keys=st.just(b"") | _packed(n + 1),
                     counts=st.just(b"") | _packed(3), values=st.just(b"") | values)


def _adds(handles: int, engine: bool,
          hostile: bool = True) -> st.SearchStrategy[tuple[NewRequest, ...]]:
    """Added requests, mostly valid: a handle near the live ones (an update when live),
    a spec (``hostile``: now and then bytes that are no Spec), a computed count (now and then past
    int64), engine-mode tokens, item data that matches the spec's items or not."""
    prompt = st.lists(st.integers(0, 600), max_size=6).map(pack_uints)
    spec = st.builds(Spec, req_id=st.sampled_from(["r0", "r1", "x"]),
                     prompt=st.one_of(prompt, prompt, prompt, _packed(600)),
                     sampling=st.none() | st.just(SamplingSpec(seed=3))).map(encode_spec)
    not_specs = st.sampled_from([msgspec.Raw(b"\x01"), msgspec.Raw(b"\x81\xa1i\x05"),
                                 msgspec.Raw(b"\x81\xa1p\xc4\x01\x09")])
    raw = (spec | not_specs) if hostile else spec
    output = _packed(600) if engine else st.just(b"")
    new = st.builds(NewRequest, handle=st.integers(0, handles + 2), spec=raw,
                    computed=st.integers(0, 50) | st.sampled_from(EDGES)
                    | st.integers((1 << 63) - 4, (1 << 63) + 4),
                    output=st.one_of(output, output, output, _packed(600)),
                    mm_data=st.sampled_from([(), (), (), (), (1,)]))
    return st.lists(new, min_size=1, max_size=2, unique_by=lambda a: a.handle).map(tuple)


def _field_values(n: int, handles: int, groups: int,
                  engine: bool) -> dict[str, st.SearchStrategy[Any]]:
    """A near-valid random value for every field of a DeltaBody and its RareBody."""
    group_rows = st.lists(_rows(n, 5000), min_size=groups - 1, max_size=groups + 1).map(tuple)
    return {
        "finished": _packed(handles + 1), "added": _adds(handles, engine),
        "schedule_drop": _packed(n + 1), "schedule_append": _packed(handles + 2),
        "scheduled_tokens": st.none() | _rows(n, 40),
        "computed_tokens": st.none() | _rows(n, 0, signed=True),
        "block_append": group_rows, "tokens": st.none() | _rows(n, 600),
        "rare.finished_unknown": st.just(("ghost",)), "rare.schedule_full": _packed(handles + 2),
        "rare.block_replace": group_rows, "rare.truncate": st.none() | _rows(n, 6),
    }


@st.composite
def _cases(draw: st.DrawFn) -> tuple[ReplicaState, DeltaBody, int | None, str]:
    """(a valid state, a mutated body, the expected digest or None, the mutation: bytes
    flipped, fields replaced, a random body, random joins, or count exceptions)."""
    stream = draw(core_streams(max_steps=6))
    groups, engine = stream["kv_groups"], stream["engine_tokens"]
    mode = TOKEN_MODE_ENGINE if engine else TOKEN_MODE_WORKER
    mirror = EngineMirror(token_mode=mode, kv_groups=groups)
    state = ReplicaState(mode, groups, keep_tables=draw(st.booleans()))
    deltas = []
    for step in stream["steps"]:
        kw = dict(step["kwargs"])
        kw["added"] = [Entry(spec_of(req, t), req.computed, req.tokens if engine else None)
                       for req, t in kw["added"]]
        delta, _ = mirror.step(kw.pop("batch"), kw.pop("nsched"), **kw)
        deltas.append(delta)
    *before, genuine = deltas
    for delta in before:
        msg = codec.decode(codec.encode(delta))
        assert isinstance(msg, Delta)
        state.apply(msg.body, msg.digest)
    n = int(state.schedule.size)
    handles = max([0, *state.live_handles().tolist()]) + 1
    kind = draw(st.sampled_from(["flip", "field", "random", "adds", "counts"]))
    expected = draw(st.sampled_from([None, None, genuine.digest ^ 1]))  # (synthetic bodies)
    body = genuine.body
    if kind == "flip":  # bytes of the body changed (the header's are the replica's business)
        encoded = codec.encode(genuine)[0]
        for _ in range(8):  # until the bytes decode to a Delta
            frame = bytearray(encoded)
            for _ in range(draw(st.integers(1, 3))):
                at = draw(st.integers(min(14, len(frame) - 1), len(frame) - 1))
                frame[at] ^= 1 << draw(st.integers(0, 7))
            try:
                msg = codec.decode([bytes(frame)])
            except MalformedMessage:
                continue
            if isinstance(msg, Delta):
                body, expected = msg.body, draw(st.sampled_from([msg.digest, None]))
                break
        else:
            kind = "field"
    if kind == "field":
        values = _field_values(n, handles, groups, engine)
        for name in draw(st.lists(st.sampled_from(sorted(values)), min_size=1, max_size=2,
                                  unique=True)):
            value = draw(values[name])
            if name.startswith("rare."):
                rare = msgspec.structs.replace(body.rare, **{name[5:]: value})
                body = msgspec.structs.replace(body, rare=rare)
            else:
                body = msgspec.structs.replace(body, **{name: value})
    elif kind == "adds":  # requests joining (new handles, updates) and scheduled at once
        adds = draw(_adds(handles, engine, hostile=False))
        fresh = [a.handle for a in adds if a.handle >= state.cols.capacity
                 or state.cols.pos[a.handle] < 0]
        body = DeltaBody(added=adds, schedule_append=pack_uints(fresh) if fresh else b"")
    elif kind == "counts" and n:  # count exceptions at distinct scheduled positions
        def exceptions(signed: bool) -> Rows | None:
            at = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=4))
            if signed:
                big = st.sampled_from([-(1 << 63), -(1 << 62), (1 << 62), (1 << 63) - 1])
                values = pack_sints([draw(st.integers(-5, 5) | big) for _ in at])
            else:
                values = pack_uints([draw(st.integers(0, 9) | st.sampled_from(EDGES))
                                     for _ in at])
            return Rows(keys=pack_uints(at), values=values) if at else None
        body = msgspec.structs.replace(body, scheduled_tokens=exceptions(False),
                                       computed_tokens=exceptions(True))
    elif kind == "random":
        values = _field_values(n, handles, groups, engine)
        fields = draw(st.fixed_dictionaries({}, optional=values))
        rare_fields = {k[5:]: v for k, v in fields.items() if k.startswith("rare.")}
        plain = {k: v for k, v in fields.items() if not k.startswith("rare.")}
        body = DeltaBody(**plain, rare=RareBody(**rare_fields))
    return state, body, expected, kind


@settings(max_examples=500, deadline=None)
@given(_cases())
def test_a_mutated_body_applies_whole_or_changes_nothing(
        case: tuple[ReplicaState, DeltaBody, int | None, str]) -> None:
    state, body, expected, kind = case
    assert state.digest == state.recompute_digest()
    before = state_fingerprint(state)
    try:
        state.apply(body, expected)
    except ProtocolError as exc:
        event(f"{kind}: refused ({type(exc).__name__})")
        assert state_fingerprint(state) == before, "a refused body changed the state"
        assert state.digest == state.recompute_digest()
        return
    event(f"{kind}: applied")
    assert expected is None or state.digest == expected
    assert state.digest == state.recompute_digest(), "applied, but the digest is not the state's"
    live = state.live_handles()
    assert (state.cols.computed[live] >= 0).all(), "a computed count wrapped past int64"
    if state.tables is not None:  # the state a late joiner gets is this one
        assert load_snapshot(build_snapshot(state, 1, 1)).digest == state.digest


def test_a_request_re_added_in_place_with_an_empty_append_applies() -> None:
    """A live, scheduled handle added again (an update) while ``schedule_append`` is the
    empty list's encoding: the handle keeps its position with a count of 1 (found by the
    property above: the previous counts are read-only and must not be written)."""
    _, delta = first_step(2, 1)
    state = ReplicaState(TOKEN_MODE_WORKER, 1)
    state.apply(delta.body, delta.digest)
    again = NewRequest(handle=0, spec=encode_spec(Spec(req_id="r0", prompt=pack_uints([1]))),
                       computed=0)
    state.apply(DeltaBody(added=(again,), schedule_append=pack_uints([])), None)
    assert state.schedule.tolist() == [0, 1]
    assert state.nsched.tolist()[0] == 1
    assert state.digest == state.recompute_digest()


_UNBUILDABLE = {
    "drafts past the schedule": DeltaBody(spec_tokens=Rows(keys=pack_uints([7]),
                                                           values=pack_uints([1]))),
    "draft counts not adding up": DeltaBody(spec_tokens=Rows(counts=pack_uints([2]),
                                                             values=pack_uints([1]))),
    "encoder inputs past the schedule": DeltaBody(rare=RareBody(encoder_inputs=Rows(
        keys=pack_uints([9]), values=pack_uints([1])))),
    "a preempted handle not live": DeltaBody(rare=RareBody(preempted=pack_uints([50]))),
    "a resumed handle not live": DeltaBody(rare=RareBody(resumed=pack_uints([50]))),
    "an extension that is no map": DeltaBody(extension=b"\x01"),
    "blocks to zero cut short": DeltaBody(rare=RareBody(blocks_to_zero=b"\x09")),
}


@pytest.mark.parametrize("name", list(_UNBUILDABLE))
def test_per_step_fields_a_receiver_cannot_build_are_the_peers_error(name: str) -> None:
    """The fields the digest does not cover (drafts, encoder inputs, preempted and
    resumed ids, the extension, blocks to zero) must still fit the step: a body whose
    step cannot be built is refused by ``apply`` (the state unchanged) or by
    ``rebuild_request``, as a RemoteProtocolError -- never an IndexError, a msgspec
    error or a LocalProtocolError that would take a receiver down."""
    _, first = first_step(3, 1)
    state = ReplicaState()
    state.apply(first.body, first.digest)
    body = _UNBUILDABLE[name]
    before = state_fingerprint(state)
    try:
        applied = state.apply(body)
    except RemoteProtocolError:
        assert state_fingerprint(state) == before
        return
    with pytest.raises(RemoteProtocolError):
        rebuild_request(state, body, applied, {})
