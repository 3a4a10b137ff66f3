"""Python-int paths for the few items of a common step agree with the numpy paths:
short packed arrays, digest changes, and same-schedule deltas applied to a state."""

from __future__ import annotations

from typing import Any

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


@given(st.lists(st.integers(0, (1 << 20) + 64), max_size=40))
def test_cached_handle_keys_match_the_mixed_ones(handles: list[int]) -> None:
    """The process-wide key table (grown on demand, bypassed past its limit) gives the
    keys the mixing function gives; one handle's spec term likewise on Python ints."""
    expected = dg._handle_keys_uncached(handles) if handles else np.zeros(0, np.uint64)
    assert dg.handle_keys(handles).tolist() == expected.tolist()
    assert [dg.handle_key_int(h) for h in handles] == expected.tolist()
    for h in handles[:4]:
        assert dg.spec_term_int(h, h * 7919) == int(dg.spec_terms([h], [h * 7919])[0])


def _general_bodies(state: ReplicaState) -> list[DeltaBody]:
    """Bodies that finish handle 0, add handle 5 and edit tables, some of them refused."""
    from protocol.messages import NewRequest

    add = NewRequest(handle=5, req_id="r5", prompt=pack_uints(list(range(8))))
    sched = state.schedule.tolist()
    common: dict[str, Any] = {"finished": pack_uints([0]), "added": (add,),
              "schedule_drop": pack_uints([0]), "schedule_append": pack_uints([5])}
    replace = Rows(handles=pack_uints([5, 1]), counts=pack_uints([3, 0]),
                   values=pack_uints([40, 41, 42]))
    append = Rows(handles=pack_uints([2, 5]), counts=pack_uints([2, 1]),
                  values=pack_uints([50, 51, 52]))
    bad = [Rows(handles=pack_uints([0]), values=pack_uints([1])),  # finished: not live
           Rows(handles=pack_uints([2, 2]), values=pack_uints([1, 2])),  # repeated
           Rows(handles=pack_uints([2]), counts=pack_uints([2]), values=pack_uints([1])),
           Rows(handles=pack_uints([2]), values=pack_uints([1 << 31]))]  # over 31 bits
    assert sched == [0, 1, 2]
    bodies = [DeltaBody(**common, block_replace=(replace,)),
              DeltaBody(**common, block_append=(append,)),
              DeltaBody(**common, block_replace=(replace,), block_append=(append,))]
    bodies += [DeltaBody(**common, block_append=(rows,)) for rows in bad]
    return bodies + [DeltaBody(**common, block_replace=(rows,)) for rows in bad]


def test_few_block_edits_of_general_steps_match_the_numpy_path() -> None:
    """Replacements and appends of a step that also finishes and adds (Python ints for a
    few rows) give the numpy path's tables and digest, and refuse what it refuses with
    the same error, leaving the state unchanged."""
    import pytest

    from protocol.plan_blocks import BlockPlanner

    def outcome(body: DeltaBody) -> tuple[object, ...]:
        mirror = EngineMirror()
        mirror.diff(_request(3, [8] * 3, [1] * 3, [[0], [1, 2], [3]]))
        state: ReplicaState = mirror.state
        before = state.digest
        try:
            state.apply(body)
        except Exception as exc:  # noqa: BLE001 - compared below
            assert state.digest == before == state.recompute_digest()
            return type(exc).__name__, str(exc)
        assert state.digest == state.recompute_digest()
        return state.digest, [state.blocks[0][h].tolist() for h in (1, 2, 5)]

    mirror = EngineMirror()
    mirror.diff(_request(3, [8] * 3, [1] * 3, [[0], [1, 2], [3]]))
    few_edit, taken = BlockPlanner._few_edit, []

    def spy(self: BlockPlanner, *args: object) -> object:
        edit = few_edit(self, *args)  # type: ignore[arg-type]
        taken.append(edit is not None)
        return edit

    refused = 0
    for body in _general_bodies(mirror.state):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(BlockPlanner, "_few_edit", spy)
            fast = outcome(body)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(BlockPlanner, "_few_edit", lambda *args: None)
            assert outcome(body) == fast
        refused += fast[0] == "InvalidDelta"
    assert refused == 8 and taken[:3] == [True] * 3


def _general_run(steps: list[list[tuple[str, int, int]]]) -> list[tuple[DeltaBody, int, int]]:
    """Requests of (id, computed, scheduled) rows through a verifying mirror: each step's
    body, digest and recomputed digest."""
    prompt = np.arange(8, dtype=np.int64)
    prompt.flags.writeable = False
    specs = {rid: RequestSpec(rid, prompt) for step in steps for rid, _, _ in step}
    mirror = EngineMirror(verify=True)
    out: list[tuple[DeltaBody, int, int]] = []
    for rows in steps:
        ids = [rid for rid, _, _ in rows]
        request = ExecuteModelRequest(
            req_ids=ids, specs=[specs[rid] for rid in ids],
            num_scheduled_tokens=np.array([s for _, _, s in rows], dtype=np.int64),
            num_computed_tokens=np.array([c for _, c, _ in rows], dtype=np.int64),
            block_tables=(Ragged.from_lists([[int(rid[1:])] for rid in ids]),),
            spec_token_ids=Ragged.empty(len(ids)), encoder_inputs=Ragged.empty(len(ids)))
        body = mirror.diff(request).body
        out.append((body, mirror.state.digest, mirror.state.recompute_digest()))
    return out


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_few_count_paths_of_changed_schedules_match_the_numpy_paths(
        data: st.DataObject) -> None:
    """Schedules that drop, add and reorder requests, with computed and scheduled counts
    off the prediction: the Python-int count paths give the numpy paths' bodies and
    digests (and the digest recomputed from scratch)."""
    import pytest

    from protocol import plan, plan_counts

    pool = [f"r{i}" for i in range(12)]
    steps, computed = [], dict.fromkeys(pool, 0)
    for _ in range(data.draw(st.integers(2, 6))):
        ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=12, unique=True))
        rows = []
        for rid in ids:
            computed[rid] += data.draw(st.integers(-2, 5))
            computed[rid] = max(computed[rid], 0)
            rows.append((rid, computed[rid], data.draw(st.integers(1, 4))))
        steps.append(rows)
    few = _general_run(steps)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan, "FEW_ROWS", 0)  # the schedule edits
        mp.setattr(plan_counts, "FEW_ROWS", 0)  # the computed and scheduled counts
        assert _general_run(steps) == few
    assert all(digest == recomputed for _, digest, recomputed in few)
