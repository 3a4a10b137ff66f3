"""Python-int paths for the few items of a common step agree with the numpy paths:
short packed arrays, digest changes, and same-schedule deltas applied to a state."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_side.mirror import EngineMirror
from protocol import digest as dg
from protocol.messages import DeltaBody, Rows
from protocol.packing import (
    SMALL,
    pack_sints,
    pack_uints,
    unpack_sint_list,
    unpack_sints,
    unpack_uint_list,
    unpack_uints,
)
from protocol.plan import STEADY_BODY
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
from protocol.state import ReplicaState

INT64 = (1 << 63) - 1


@given(st.lists(st.integers(0, INT64), max_size=SMALL + 4))
def test_short_lists_pack_like_arrays(values: list[int]) -> None:
    packed = pack_uints(values)
    assert packed == pack_uints(np.array(values, dtype=np.int64))
    assert unpack_uint_list(packed) == values == unpack_uints(packed).tolist()


@given(st.lists(st.integers(-INT64 - 1, INT64), max_size=SMALL + 4))
def test_short_signed_lists_pack_like_arrays(values: list[int]) -> None:
    packed = pack_sints(values)
    assert packed == pack_sints(np.array(values, dtype=np.int64))
    assert unpack_sint_list(packed) == values == unpack_sints(packed).tolist()


@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 5000), st.integers(0, 999),
                          st.integers(0, 999)), max_size=2 * dg.SMALL))
def test_digest_changes_match_the_numpy_terms(items: list[tuple[int, int, int, int]]) -> None:
    hs, pos, old, new = (list(c) for c in zip(*items, strict=True)) if items else ([],) * 4
    keys = dg.mix64(dg._u64(hs) * dg._K_SCHED + dg._u64(pos) * dg._K_POS) | np.uint64(1)
    expected = (dg.total((dg._u64(new) + np.uint64(1)) * keys)
                - dg.total((dg._u64(old) + np.uint64(1)) * keys)) & dg.MASK
    assert dg.schedule_change(hs, pos, old, new) == (expected if items else 0)
    deltas = [b - a for a, b in zip(old, new, strict=True)]
    expected = (dg.total(dg.computed_terms(hs, new)) - dg.total(dg.computed_terms(hs, old)))
    assert dg.computed_change(hs, deltas) == (expected & dg.MASK if items else 0)
    if items:
        assert dg.block_row_sums(hs[0], 1, pos[0], new) == dg.total(
            dg.block_terms(hs[0], 1, pos[0], new))
    assert dg.block_unit_terms(hs, 2, pos, new) == dg.block_terms_rows(hs, 2, pos, new).tolist()
    for counts in ([1] * len(hs), [k % 3 for k in range(len(hs))]):  # numpy past dg.SMALL
        flat = [v for v, c in zip(new, counts, strict=True) for _ in range(c)]
        rows, at = [], 0
        for h, p, c in zip(hs, pos, counts, strict=True):
            rows.append(dg.total(dg.block_terms(h, 0, p, flat[at:at + c])) if c else 0)
            at += c
        assert dg.row_terms(hs, 0, pos, counts, flat) == rows


def _request(n: int, computed: list[int], nsched: list[int],
             tables: list[list[int]]) -> ExecuteModelRequest:
    ids = [f"r{i}" for i in range(n)]
    prompt = np.arange(8, dtype=np.int64)
    prompt.flags.writeable = False
    return ExecuteModelRequest(
        req_ids=ids, specs=[RequestSpec(rid, prompt) for rid in ids],
        num_scheduled_tokens=np.array(nsched, dtype=np.int64),
        num_computed_tokens=np.array(computed, dtype=np.int64),
        block_tables=(Ragged.from_lists(tables),), spec_token_ids=Ragged.empty(n),
        encoder_inputs=Ragged.empty(n))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.data())
def test_same_schedule_deltas_keep_the_digest(n: int, data: st.DataObject) -> None:
    """Count exceptions, changed scheduled counts and block appends, then steady steps:
    the incremental digest equals the one recomputed from scratch."""
    computed, nsched = [8] * n, [1] * n
    tables = [[i] for i in range(n)]
    mirror = EngineMirror(verify=True)
    mirror.diff(_request(n, computed, nsched, tables))
    for step in range(6):
        computed = [c + s for c, s in zip(computed, nsched, strict=True)]
        for i in data.draw(st.lists(st.integers(0, n - 1), max_size=4, unique=True)):
            computed[i] = max(0, computed[i] + data.draw(st.integers(-3, 3)))
        for i in data.draw(st.lists(st.integers(0, n - 1), max_size=4, unique=True)):
            nsched[i] = data.draw(st.integers(1, 4))
        for i in data.draw(st.lists(st.integers(0, n - 1), max_size=40)):
            tables[i] = tables[i] + [1000 * step + i]
        mirror.diff(_request(n, computed, list(nsched), [list(t) for t in tables]))
        assert mirror.state.recompute_digest() == mirror.state.digest
    for _ in range(3):
        computed = [c + s for c, s in zip(computed, nsched, strict=True)]
        assert mirror.diff(_request(n, computed, list(nsched), tables)).body == STEADY_BODY
        assert mirror.state.recompute_digest() == mirror.state.digest


def test_a_same_schedule_body_is_checked_before_anything_changes() -> None:
    mirror = EngineMirror()
    mirror.diff(_request(3, [8] * 3, [1] * 3, [[0], [1], [2]]))
    state: ReplicaState = mirror.state
    before = state.digest
    bad = DeltaBody(computed_tokens=Rows(handles=pack_uints([1]), values=pack_sints([-20])))
    try:
        state.apply(bad)
    except Exception as exc:  # noqa: BLE001 - the type is checked below
        assert type(exc).__name__ == "InvalidDelta"
    else:
        raise AssertionError("a negative computed count was applied")
    assert state.digest == before == state.recompute_digest()


def test_bad_block_appends_are_refused_unchanged() -> None:
    """The few-appends path keeps the general checks: a handle not live, a repeated
    handle, a shape mismatch and a count-overflowing exception are all refused."""
    mirror = EngineMirror()
    mirror.diff(_request(3, [8] * 3, [1] * 3, [[0], [1], [2]]))
    state: ReplicaState = mirror.state
    before = state.digest
    bad = [Rows(handles=pack_uints([7]), values=pack_uints([5])),
           Rows(handles=pack_uints([1, 1]), values=pack_uints([5, 6])),
           Rows(handles=pack_uints([1]), counts=pack_uints([2]), values=pack_uints([5]))]
    bodies = [DeltaBody(block_append=(rows,)) for rows in bad]
    bodies.append(DeltaBody(computed_tokens=Rows(handles=pack_uints([0]),
                                                 values=pack_sints([(1 << 63) - 9]))))
    for body in bodies:
        try:
            state.apply(body)
        except Exception as exc:  # noqa: BLE001 - the type is checked below
            assert type(exc).__name__ == "InvalidDelta", exc
        else:
            raise AssertionError(f"applied {body}")
        assert state.digest == before == state.recompute_digest()
    good = DeltaBody(block_append=(Rows(handles=pack_uints([2, 0]), counts=pack_uints([2, 1]),
                                        values=pack_uints([9, 10, 11])),))
    state.apply(good)
    assert state.digest == state.recompute_digest()
    assert state.blocks[0][2].tolist() == [2, 9, 10] and state.blocks[0][0].tolist() == [0, 11]


def test_absent_counts_mean_one_value_per_row() -> None:
    """SPEC §6 Rows: ``n`` absent = one value per row, for block rows and aligned rows."""
    mirror = EngineMirror()
    mirror.diff(_request(3, [8] * 3, [1] * 3, [[0], [1], [2]]))
    state: ReplicaState = mirror.state
    state.apply(DeltaBody(block_append=(Rows(handles=pack_uints([2, 0]),
                                             values=pack_uints([9, 11])),),
                          spec_tokens=Rows(values=pack_uints([4, 5, 6]))))
    assert state.digest == state.recompute_digest()
    assert state.blocks[0][2].tolist() == [2, 9] and state.blocks[0][0].tolist() == [0, 11]
    assert state.rebuild().spec_token_ids.to_lists() == [[4], [5], [6]]
