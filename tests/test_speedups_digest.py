"""The C speedups of the digest's terms and the steady lane's plans
(protocol/_speedups_digest.c, _speedups_lane.c) against their Python references."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import digest as dg
from protocol import lane_lists
from protocol.speedups import C

needs_c = pytest.mark.skipif(C is None, reason="C speedups not built (no C compiler)")

U64 = st.integers(0, (1 << 64) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)


@needs_c
@given(st.data())
def test_unit_terms_match_the_reference(data: st.DataObject) -> None:
    assert C is not None
    n = data.draw(st.integers(0, 40))
    rows = [data.draw(st.lists(I64, min_size=n, max_size=n)) for _ in range(3)]
    group = data.draw(st.integers(0, 7))
    g = (group * dg._GROUP_I) & dg.MASK
    got = C.unit_terms(*rows, g, dg._SPEC_I, dg._POS_I, dg._HANDLE_I)
    assert got == dg.unit_terms_py(rows[0], g, rows[1], rows[2])
    assert dg.block_unit_terms(rows[0], group, rows[1], rows[2]) == got


@needs_c
def test_unit_terms_refuse_what_they_cannot_take() -> None:
    assert C is not None
    args = (0, dg._SPEC_I, dg._POS_I, dg._HANDLE_I)
    assert C.unit_terms([1], [2], [3, 4], *args) is None  # lengths differ
    assert C.unit_terms((1,), [2], [3], *args) is None  # not a list
    assert C.unit_terms([1 << 64], [2], [3], *args) is None  # past int64: Python's arithmetic
    with pytest.raises(ValueError):  # the reference refuses unequal lengths
        dg.block_unit_terms([1], 0, [2], [3, 4])



@needs_c
@given(st.lists(st.integers(-(1 << 62), 1 << 62), min_size=1, max_size=20), st.data())
def test_add_at_adds_in_place_all_or_nothing(target: list[int], data: st.DataObject) -> None:
    assert C is not None
    k = data.draw(st.integers(0, 10))
    pos = data.draw(st.lists(st.integers(-2, len(target) + 1), min_size=k, max_size=k))
    counts = data.draw(st.lists(st.integers(-(1 << 31) - 1, 1 << 31), min_size=k, max_size=k))
    expected = list(target)
    taken = all(0 <= p < len(target) for p in pos) \
        and all(-(1 << 31) <= c < 1 << 31 for c in counts)
    if taken:
        for p, c in zip(pos, counts, strict=True):
            expected[p] += c
    before = list(target)
    assert C.add_at(target, pos, counts) is (True if taken else None)
    assert target == (expected if taken else before)


@needs_c
@given(st.data())
def test_dot_is_the_digest_sum_mod_2_64(data: st.DataObject) -> None:
    assert C is not None
    keys = data.draw(st.lists(U64, max_size=30))
    n = data.draw(st.integers(0, 30))
    values = data.draw(st.lists(I64, min_size=n, max_size=n))
    at = data.draw(st.lists(st.integers(0, max(len(keys) - 1, 0)), min_size=n, max_size=n))
    if keys:
        want = sum(v * keys[k] for v, k in zip(values, at, strict=True)) & dg.MASK
        assert C.dot(values, keys, at) == want
        assert lane_lists.dot(values, keys, at) & dg.MASK == want
    same = values[: len(keys)] + [0] * (len(keys) - len(values[: len(keys)]))
    assert C.dot(same, keys) == sum(v * k for v, k in zip(same, keys, strict=True)) & dg.MASK


@needs_c
def test_dot_refuses_what_it_cannot_take() -> None:
    assert C is not None
    assert C.dot([1, 2], [3]) is None  # lengths differ without positions
    assert C.dot([1], [3], [1]) is None  # a position out of range
    assert C.dot([1], [3], [-1]) is None  # negative: Python's wrap-around decides
    assert C.dot([1 << 63], [3]) is None  # past int64
    assert C.dot([1], [1 << 64]) is None  # a key past 2**64
    assert lane_lists.dot([1], [3], [-1]) == 3


@needs_c
@settings(max_examples=200)
@given(st.data())
def test_keyed_sum_is_the_linear_count_terms(data: st.DataObject) -> None:
    """C's keyed sums are the numpy references: computed_change and schedule_term."""
    assert C is not None
    n = data.draw(st.integers(0, 40))
    handles = data.draw(st.lists(st.integers(0, 1 << 40), min_size=n, max_size=n))
    values = data.draw(st.lists(st.integers(-(1 << 40), 1 << 40), min_size=n, max_size=n))
    want_change = dg.total(dg.computed_terms(handles, values))
    want_term = dg.total((dg._u64(values) + np.uint64(1)) * dg.schedule_keys(handles))
    assert C.keyed_sum(handles, values, dg._COMP_I, dg._HANDLE_I, 0, 0) == want_change
    assert dg.computed_change(handles, values) == want_change
    assert dg.schedule_term(np.array(handles, dtype=np.int64),
                            np.array(values, dtype=np.int64)) == want_term
    assert dg.schedule_term(handles, values) == want_term


@needs_c
def test_keyed_sum_refuses_what_it_cannot_take() -> None:
    assert C is not None
    args = (dg._COMP_I, dg._HANDLE_I, 0, 0)
    assert C.keyed_sum([1, 2], [3], *args) is None  # lengths differ
    assert C.keyed_sum((1,), [3], *args) is None  # not a list
    assert C.keyed_sum([1], [1 << 63], *args) is None  # past int64: Python decides
    assert C.keyed_sum([1], [2.0], *args) is None  # not an int
    # the Python paths take what C refuses, with their own arithmetic and errors
    assert dg.computed_change([1], [1 << 63]) == ((1 << 63) * dg.handle_key_int(1)) & dg.MASK
    with pytest.raises(OverflowError):
        dg.schedule_term([1], [1 << 63])


@needs_c
@settings(max_examples=200)
@given(st.lists(st.integers(0, 1 << 40), max_size=80))
def test_key_list_is_the_numpy_keys(handles: list[int]) -> None:
    """C's key lists are the numpy references (schedule keys by position, handle keys),
    and the Python fallbacks give the same lists."""
    assert C is not None
    want_sched, want_handle = dg.schedule_keys(handles).tolist(), dg.handle_keys(handles).tolist()
    assert C.key_list(handles, dg._SCHED_I, 0, dg._POS_I) == want_sched
    assert dg.schedule_key_list(handles) == want_sched
    assert dg.handle_key_list(handles) == want_handle
    assert list(map(dg.handle_key_int, handles)) == want_handle


@needs_c
def test_key_list_refuses_what_it_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    assert C is not None
    assert C.key_list((1, 2), 3, 0, 5) is None  # not a list
    assert C.key_list([1, 1 << 63], 3, 0, 5) is None  # past int64
    assert C.key_list([1, 2.0], 3, 0, 5) is None  # not an int
    monkeypatch.setattr(dg, "_C", None)  # the fallbacks, small and numpy-sized
    for handles in ([3, 1, 2], list(range(100))):
        assert dg.handle_key_list(handles) == dg.handle_keys(handles).tolist()
        assert dg.schedule_key_list(handles) == dg.schedule_keys(handles).tolist()



def _reference_plan(pos: list[int], counts: list[int], ids: list[int], handles: list[int],
                    lengths: list[int], group: int, check: bool) -> object:
    """protocol.lane.SteadyLane._plan on Python ints (None: the lane refuses the rows)."""
    if check and not lane_lists.rows_fit(pos, counts, len(ids), len(handles)):
        return None
    if not ids or min(ids) < 0 or max(ids) >= 1 << 31:
        return None
    hs = [handles[p] for p in pos]
    starts = [lengths[p] for p in pos]
    terms, at = [], 0
    for h, start, n in zip(hs, starts, counts, strict=True):
        terms.append(dg.block_row_sums(h, group, start, ids[at:at + n]))
        at += n
    return hs, starts, terms, sum(terms) & dg.MASK


@st.composite
def _plan_case(draw: st.DrawFn) -> tuple[Any, ...]:
    """(positions, counts, ids, handles, lengths, group, check): valid appends of one
    group, then maybe one flaw."""
    n = draw(st.integers(1, 12))
    handles = draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n))
    lengths = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    k = draw(st.integers(1, n))
    pos = draw(st.permutations(range(n)))[:k]
    counts = draw(st.lists(st.integers(1, 3), min_size=k, max_size=k))
    ids = draw(st.lists(st.integers(0, (1 << 31) - 1), min_size=sum(counts),
                        max_size=sum(counts)))
    flaw = draw(st.sampled_from(["none", "none", "none", "position", "repeat", "count",
                                 "id", "extra id", "missing id"]))
    if flaw == "position":
        pos[-1] = draw(st.sampled_from([-1, n]))
    elif flaw == "repeat":
        pos.append(pos[0])
        counts.append(1)
        ids.append(7)
    elif flaw == "count":
        counts[-1] = 0
    elif flaw == "id":
        ids[-1] = draw(st.sampled_from([-1, 1 << 31]))
    elif flaw == "extra id":
        ids.append(3)
    elif flaw == "missing id":
        ids.pop()
    return pos, counts, ids, handles, lengths, draw(st.integers(0, 3)), draw(st.booleans())


@needs_c
@given(_plan_case())
def test_plan_rows_is_the_lanes_plan(case: tuple[Any, ...]) -> None:
    assert C is not None
    pos, counts, ids, handles, lengths, group, check = case
    got = C.plan_rows(pos, counts, ids, handles, lengths, dg.group_salt(group),
                      *dg.BLOCK_KEYS, check)
    if check:
        assert got == _reference_plan(pos, counts, ids, handles, lengths, group, True)
    elif got is not None:  # unchecked rows: C takes a subset, and agrees on it
        assert got == _reference_plan(pos, counts, ids, handles, lengths, group, False)


@needs_c
@given(_plan_case(), st.integers(0, (1 << 64) - 1), st.sampled_from(["none", "same", "other"]))
def test_lane_append_is_plan_digest_and_lengths(case: tuple[Any, ...], base: int,
                                                expect: str) -> None:
    """The plan of plan_rows, the digest ``base + sum`` and, only when that is the
    expected digest, the lengths advanced; an int (nothing changed) when it is not."""
    assert C is not None
    pos, counts, ids, handles, lengths, group, check = case
    salt = dg.group_salt(group)
    plan = C.plan_rows(pos, counts, ids, handles, lengths, salt, *dg.BLOCK_KEYS, check)
    digest = None if plan is None else (base + plan[3]) & dg.MASK
    expected = {"none": None, "same": digest, "other": None if digest is None
                else (digest + 1) & dg.MASK}[expect]
    before = list(lengths)
    got = C.lane_append(pos, counts, ids, handles, lengths, salt, *dg.BLOCK_KEYS, check,
                        base, expected)
    if plan is None:
        assert got is None and lengths == before
    elif expect == "other":
        assert got == digest and lengths == before
    else:
        assert got == (*plan[:3], digest)
        for p, c in zip(pos, counts, strict=True):
            before[p] += c
        assert lengths == before


def _reference_plan_counts(comp: list[int], ns: list[int], keys: list[int], at: list[int],
                           moves: list[int], pos: list[int], values: list[int],
                           skeys: list[int], advance: int) -> tuple[Any, ...] | None:
    """SteadyLane._plan_counts' Python lines on the same lists (None: refused)."""
    change = 0
    if moves:
        after = [comp[p] + ns[p] + d for p, d in zip(at, moves, strict=True)]
        if min(after) < 0 or max(after) >= 1 << 62:
            return None
        change = sum(d * keys[p] for p, d in zip(at, moves, strict=True))
    nsched = None
    if max(values, default=0) >= 1 << 62:
        return None
    before = [ns[p] for p in pos]
    if before != values:
        deltas = [v - b for v, b in zip(values, before, strict=True)]
        change += sum(d * skeys[p] for p, d in zip(pos, deltas, strict=True))
        advance += sum(d * keys[p] for p, d in zip(pos, deltas, strict=True))
        nsched = list(ns)
        for p, v in zip(pos, values, strict=True):
            nsched[p] = v
    return change & dg.MASK, nsched, advance & dg.MASK


@needs_c
@given(st.data())
def test_plan_counts_is_the_lanes_count_plan(data: st.DataObject) -> None:
    """Distinct in-range positions (what the lane passes): the Python lines' answer,
    refusals included; any position out of range or count past 2**62: None."""
    assert C is not None
    n = data.draw(st.integers(1, 12))
    counts = st.integers(0, 5000) if data.draw(st.integers(0, 9)) else \
        st.sampled_from([0, (1 << 62) - 1, 1 << 62])
    comp = data.draw(st.lists(counts, min_size=n, max_size=n))
    ns = data.draw(st.lists(st.integers(0, 8), min_size=n, max_size=n))
    keys, skeys = (data.draw(st.lists(U64, min_size=n, max_size=n)) for _ in range(2))
    at = data.draw(st.permutations(range(n)))[:data.draw(st.integers(0, n))]
    moves = data.draw(st.lists(st.integers(-6000, 6000), min_size=len(at), max_size=len(at)))
    pos = data.draw(st.permutations(range(n)))[:data.draw(st.integers(0, n))]
    values = data.draw(st.lists(st.one_of(st.integers(0, 8), counts), min_size=len(pos),
                                max_size=len(pos)))
    advance = data.draw(U64)
    args = (comp, ns, keys, at, moves, pos, values, skeys, advance)
    want = _reference_plan_counts(*args)
    got = C.plan_counts(*args)
    assert got == want
    if at or pos:  # a position out of range is not taken
        bad = (at + [n], moves + [1]) if at else (at, moves)
        assert C.plan_counts(comp, ns, keys, *bad, pos + ([n] if not at else []),
                             values + ([1] if not at else []), skeys, advance) is None
