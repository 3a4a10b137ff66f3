"""ReplicaState's steady-step-with-appends path (``_steady_appends``: the Lookahead kept,
Python-int rows) equals the general prepare/commit on every body it takes: the same
digest, recomputed digest, rebuilt request and refusals (state unchanged)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from replica_bodies import first_body

from protocol.errors import InvalidDelta, MalformedMessage
from protocol.messages import DeltaBody, Rows
from protocol.packing import pack_sints, pack_uints
from protocol.plan import STEADY_BODY
from protocol.request import request_differences
from protocol.state import ReplicaState


class GeneralState(ReplicaState):
    """Every body through prepare/commit (the reference)."""

    def _steady_appends(self, body: DeltaBody, expected_digest: int | None) -> bool:
        return False




@st.composite
def _rows(draw: st.DrawFn, n: int, many: bool) -> Rows:
    """Block appends, mostly valid: live handles (sometimes one past the last, sometimes
    repeated), one block each or explicit counts, sometimes a shape mismatch."""
    handles = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=60 if many else 6,
                            unique=draw(st.integers(0, 9)) > 0))
    if draw(st.integers(0, 19)) == 0:
        handles.append(n + draw(st.integers(0, 3)))
    counts = None if draw(st.booleans()) else draw(
        st.lists(st.integers(0, 3), min_size=len(handles), max_size=len(handles)))
    size = len(handles) if counts is None else sum(counts)
    size += 1 if draw(st.integers(0, 19)) == 0 else 0
    values = draw(st.lists(st.integers(0, (1 << 31) - 1), min_size=size, max_size=size))
    return Rows(handles=pack_uints(handles), values=pack_uints(values),
                counts=b"" if counts is None else pack_uints(counts))


@st.composite
def _body(draw: st.DrawFn, n: int, groups: int) -> DeltaBody:
    kind = draw(st.sampled_from(["appends"] * 6 + ["steady", "computed", "groups"]))
    if kind == "steady":
        return STEADY_BODY
    if kind == "computed":  # a general step between: the Lookahead is dropped
        return DeltaBody(computed_tokens=Rows(handles=pack_uints([draw(st.integers(0, n - 1))]),
                                              values=pack_sints([draw(st.integers(-2, 2))])))
    many = draw(st.integers(0, 4)) == 0
    count = groups if kind == "appends" else groups + draw(st.sampled_from([-1, 1]))
    rows = tuple(draw(_rows(n, many)) for _ in range(count))
    ext = {"v": b"\x80"} if draw(st.booleans()) else {}
    return DeltaBody(block_append=rows, extension=ext)


def _apply(state: ReplicaState, body: DeltaBody, expected: int | None) -> str:
    try:
        state.apply(body, expected_digest=expected)
    except (InvalidDelta, MalformedMessage) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 50), st.integers(1, 2), st.data())
def test_steady_appends_equal_the_general_path(n: int, groups: int, data: st.DataObject) -> None:
    fast, general = ReplicaState(kv_groups=groups), GeneralState(kv_groups=groups)
    first = first_body(n, groups)
    for state in (fast, general):
        state.apply(first)
    taken = 0
    for _ in range(data.draw(st.integers(1, 30))):
        body = data.draw(_body(n, groups))
        expected = None if data.draw(st.integers(0, 5)) else data.draw(
            st.sampled_from([fast.digest, 12345]))
        before = fast.digest
        error = _apply(fast, body, expected)
        assert error == _apply(general, body, expected)
        if error:
            assert fast.digest == before == fast.recompute_digest()
        taken += not error and body.block_append != ()
        assert fast.digest == general.digest
        if data.draw(st.booleans()):  # else patches of the cached tables pile up
            assert request_differences(fast.rebuild(), general.rebuild()) == []
    assert fast.digest == fast.recompute_digest() == general.recompute_digest()
    assert request_differences(fast.rebuild(), general.rebuild()) == []
    assert fast.step.extension == general.step.extension


def test_a_decode_step_with_appends_keeps_the_lookahead() -> None:
    """The point of the path: a steady step with new blocks does not drop the table."""
    state = ReplicaState()
    state.apply(first_body(8, 1))
    state.advance()
    ahead = state.lookahead()
    state.apply(DeltaBody(block_append=(Rows(handles=pack_uints([2, 5]),
                                             values=pack_uints([70, 71])),)))
    assert state.lookahead() is ahead and ahead.next == 2
    assert state.blocks[0][2].tolist()[-1] == 70 and state.digest == state.recompute_digest()
