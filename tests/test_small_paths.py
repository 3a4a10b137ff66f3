"""Python-int paths for the few items of a common step agree with the numpy paths (short
packed arrays, digest terms, the state's row writes), and the few-rows paths keep the
general checks: a bad body is refused with the state unchanged."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from core_streams import core_streams, spec_of
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle import state_fingerprint
from replica_bodies import first_step

from engine_side.mirror import EngineMirror, Entry
from protocol import digest as dg
from protocol import kernels
from protocol import state as state_module
from protocol.errors import InvalidDelta
from protocol.messages import (
    EMPTY_BODY,
    MAX_BLOCK_ID,
    TOKEN_MODE_ENGINE,
    TOKEN_MODE_WORKER,
    DeltaBody,
    RareBody,
    Rows,
    Spec,
)
from protocol.packing import (
    SMALL,
    pack_sints,
    pack_uints,
    unpack_sint_list,
    unpack_sints,
    unpack_uint_list,
    unpack_uints,
)
from protocol.rebuild import rebuild_request
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


def _every_path(fn: Any) -> list[Any]:
    """``fn()`` with the C kernels, then without them on the numpy lines (every count
    taken as many) and on the Python-int lines (every count taken as few)."""
    out = [fn()]
    for small in (0, 1 << 30):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "keyed_sum", lambda *args: None)
            patch.setattr(kernels, "row_mix_sums", lambda *args: None)
            patch.setattr(dg, "SMALL", small)
            out.append(fn())
    return out


@given(st.lists(st.tuples(st.integers(0, 1 << 24), st.integers(0, 5000),
                          st.integers(0, (1 << 31) - 1), st.integers(0, 3)),
                max_size=2 * dg.SMALL))
def test_python_int_digest_terms_equal_the_numpy_ones(
        items: list[tuple[int, int, int, int]]) -> None:
    """Every digest term has one value whichever line computes it (C kernel, numpy,
    Python ints), and it is the definition's (SPEC §5) computed term by term: keyed
    sums of counts, the schedule term, block row terms and token row terms."""
    hs, pos, values, counts = (list(c) for c in zip(*items, strict=True)) if items else ([],) * 4
    h_, c_ = np.asarray(hs, dtype=np.int64), np.asarray(values, dtype=np.int64)
    keyed = sum(c * dg.handle_key(h) for h, c in zip(hs, values, strict=True)) & dg.MASK
    assert _every_path(lambda: dg.keyed_sum(h_, c_)) == [keyed] * 3
    sched = sum((c + 1) * dg.schedule_key(h, i)
                for i, (h, c) in enumerate(zip(hs, values, strict=True))) & dg.MASK
    assert _every_path(lambda: dg.schedule_term(h_, c_)) == [sched] * 3
    flat = [v + k for v, c in zip(values, counts, strict=True) for k in range(c)]
    salt = (3 * dg.K_GROUP + dg.K_ROW) & dg.MASK
    rows, at = [], 0
    for h, p, c in zip(hs, pos, counts, strict=True):
        rows.append(sum(dg.mix64_int((v * dg.K_SPEC + (p + k) * dg.K_POS + h * dg.K_HANDLE
                                      + salt) & dg.MASK)
                        for k, v in enumerate(flat[at:at + c])) & dg.MASK)
        at += c
    assert _every_path(lambda: dg.block_row_terms(hs, 3, pos, counts, flat)) == [rows] * 3
    token_rows, at = [], 0
    for h, p, c in zip(hs, pos, counts, strict=True):
        token_rows.append(sum(dg.mix64_int((v * dg.K_TOKEN + (p + k) * dg.K_POS + h * dg.K_SPEC
                                            + dg.K_ROW) & dg.MASK)
                              for k, v in enumerate(flat[at:at + c])) & dg.MASK)
        at += c
    got = dg.token_sums(h_, np.asarray(pos, dtype=np.int64), np.asarray(counts, dtype=np.int64),
                        np.asarray(flat, dtype=np.int64))
    assert got.tolist() == token_rows


def _bodies(stream: dict[str, Any]) -> list[tuple[DeltaBody, int, int]]:
    """A core stream through a mirror: each step's body, digest and recomputed digest."""
    mode = TOKEN_MODE_ENGINE if stream["engine_tokens"] else TOKEN_MODE_WORKER
    mirror = EngineMirror(token_mode=mode, kv_groups=stream["kv_groups"])
    out = []
    for step in stream["steps"]:
        kw = dict(step["kwargs"])
        kw["added"] = [Entry(spec_of(req, t), req.computed,
                             req.tokens if stream["engine_tokens"] else None)
                       for req, t in kw["added"]]
        delta, _ = mirror.step(kw.pop("batch"), kw.pop("nsched"), **kw)
        out.append((delta.body, mirror.state.digest, mirror.state.recompute_digest()))
    return out


@settings(max_examples=60, deadline=None)
@given(stream=core_streams(max_steps=8, max_batch=40))
def test_few_rows_paths_give_the_vector_paths_bodies_and_digests(
        stream: dict[str, Any]) -> None:
    """Joins, finishes, schedule edits, count departures, block and token rows: the
    Python-int lines (every count taken as few) and the vector lines (every count taken
    as many) make the same bodies and digests, equal to the digest recomputed."""
    default = _bodies(stream)
    assert all(digest == recomputed for _, digest, recomputed in default)
    for few in (0, 1 << 30):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(dg, "SMALL", few)
            patch.setattr(state_module, "FEW_ROWS", few)
            assert _bodies(stream) == default


def _state(n: int, groups: int = 1) -> tuple[EngineMirror, ReplicaState]:
    """A mirror after its first step (tests/replica_bodies.py: ``i % 3`` blocks
    ``[100 * k + i, ...]`` for request ``i``) and a replica state of that step."""
    mirror, delta = first_step(n, groups)
    state = ReplicaState(kv_groups=groups)
    state.apply(delta.body, delta.digest)
    return mirror, state


def _refused_unchanged(state: ReplicaState, body: DeltaBody) -> None:
    before = state_fingerprint(state)
    with pytest.raises(InvalidDelta):
        state.apply(body)
    assert state_fingerprint(state) == before
    assert state.digest == state.recompute_digest()


def test_a_same_schedule_body_is_checked_before_anything_changes() -> None:
    _, state = _state(3)
    _refused_unchanged(state, DeltaBody(computed_tokens=Rows(keys=pack_uints([1]),
                                                             values=pack_sints([-20]))))


@pytest.mark.parametrize("n", [3, 40])  # the few-rows lines and the vector lines
def test_bad_block_appends_are_refused_unchanged(n: int) -> None:
    """A position outside the schedule, a repeated position, counts that do not add up,
    a block id past int32 (on one row and on many) and a group count that is not the
    state's: each refused, the state unchanged; a good append then applies."""
    _, state = _state(n)
    every = list(range(n))
    bad = [Rows(keys=pack_uints([n]), values=pack_uints([5])),
           Rows(keys=pack_uints([1, 1]), values=pack_uints([5, 6])),
           Rows(keys=pack_uints([1]), counts=pack_uints([2]), values=pack_uints([5])),
           Rows(keys=pack_uints([1]), values=pack_uints([MAX_BLOCK_ID + 1])),
           Rows(keys=pack_uints(every), values=pack_uints([5] * (n - 1) + [MAX_BLOCK_ID + 1])),
           Rows(values=pack_uints([5] * (n + 1)))]  # every position: one value too many
    for rows in bad:
        _refused_unchanged(state, DeltaBody(block_append=(rows,)))
        _refused_unchanged(state, DeltaBody(rare=RareBody(block_replace=(rows,))))
    _refused_unchanged(state, DeltaBody(block_append=(Rows(keys=pack_uints([0]),
                                                           values=pack_uints([1])),) * 2))
    _refused_unchanged(state, DeltaBody(computed_tokens=Rows(keys=pack_uints([0]),
                                                             values=pack_sints([-(1 << 40)]))))
    good = DeltaBody(block_append=(Rows(keys=pack_uints([2, 0]), counts=pack_uints([2, 1]),
                                        values=pack_uints([9, 10, MAX_BLOCK_ID])),))
    state.apply(good)
    assert state.digest == state.recompute_digest()
    assert state.tables is not None
    h0, h2 = state.schedule[0], state.schedule[2]
    assert state.tables[0].row(h2).tolist() == [2, 102, 9, 10]
    assert state.tables[0].row(h0).tolist() == [MAX_BLOCK_ID]


def test_absent_counts_mean_one_value_per_row() -> None:
    """SPEC §6 Rows: ``n`` absent = one value per row, ``h`` absent = every position in
    order, for block rows and per-step rows alike."""
    _, state = _state(3)
    body = DeltaBody(block_append=(Rows(keys=pack_uints([2, 0]), values=pack_uints([9, 11])),),
                     spec_tokens=Rows(values=pack_uints([5, 6, 7])))
    applied = state.apply(body)
    assert state.digest == state.recompute_digest()
    assert state.tables is not None
    assert state.tables[0].row(state.schedule[2]).tolist() == [2, 102, 9]
    assert state.tables[0].row(state.schedule[0]).tolist() == [11]
    request = rebuild_request(state, body, applied, {})
    assert request.spec_token_ids.to_lists() == [[4], [5], [6]]  # drafts travel as id + 1
    every = DeltaBody(block_append=(Rows(values=pack_uints([20, 21, 22])),))
    state.apply(every)
    assert [state.tables[0].row(h).tolist()[-1] for h in state.schedule] == [20, 21, 22]
    assert state.digest == state.recompute_digest()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.data())
def test_same_schedule_steps_keep_the_digest_and_end_steady(n: int, data: st.DataObject) -> None:
    """Count departures, changed scheduled counts and block appends on one schedule, then
    steady steps: the incremental digest equals the recomputed one; steady steps send
    the empty body."""
    mirror, _ = _state(n)
    computed = mirror.state.cols.computed[mirror.state.schedule].tolist()
    nsched = mirror.state.nsched.tolist()
    batch = list(mirror.batch)
    for step in range(6):
        computed = [c + s for c, s in zip(computed, nsched, strict=True)]
        for i in data.draw(st.lists(st.integers(0, n - 1), max_size=4, unique=True)):
            computed[i] = max(0, computed[i] + data.draw(st.integers(-3, 3)))
        for i in data.draw(st.lists(st.integers(0, n - 1), max_size=4, unique=True)):
            nsched[i] = data.draw(st.integers(1, 4))
        grown = sorted(set(data.draw(st.lists(st.integers(0, n - 1), max_size=40))))
        appends = [(grown, [1] * len(grown), [1000 * step + i for i in grown])]
        mirror.step(batch, list(nsched), computed=list(computed), appends=appends)
        assert mirror.state.recompute_digest() == mirror.state.digest
        assert mirror.state.cols.computed[mirror.state.schedule].tolist() == computed
    for _ in range(3):
        computed = [c + s for c, s in zip(computed, nsched, strict=True)]
        delta, _ = mirror.step(batch, list(nsched), computed=list(computed))
        assert delta.body is EMPTY_BODY
        assert mirror.state.recompute_digest() == mirror.state.digest


@pytest.mark.parametrize("n", [3, 20])  # rows written one by one, and by vector scatters
def test_rows_whose_counts_add_up_to_the_row_count_are_written_whole(n: int) -> None:
    """Block and token rows of uneven counts whose sum happens to equal the number of rows
    (here 2, 0, 1, 1, ...): every row gets all its values, not one each."""
    mirror = EngineMirror(token_mode=TOKEN_MODE_ENGINE)
    specs = [Spec(req_id=f"r{i}", prompt=pack_uints([1, 2])) for i in range(n)]
    delta, _ = mirror.step([f"r{i}" for i in range(n)], [1] * n,
                           added=[Entry(s, 0, [9, 9, 9]) for s in specs],
                           appends=[(list(range(n)), [3] * n, [5] * 3 * n)])
    state = ReplicaState(TOKEN_MODE_ENGINE)
    state.apply(delta.body, delta.digest)
    counts = [2, 0] + [1] * (n - 2)
    values = list(range(10, 10 + n))
    rows = Rows(counts=pack_uints(counts), values=pack_uints(values))
    state.apply(DeltaBody(rare=RareBody(block_replace=(rows,)), tokens=rows))
    assert state.tables is not None
    tables = [state.tables[0].row(h).tolist() for h in state.schedule]
    histories = [state.token_history(h).tolist() for h in state.schedule]
    assert tables[:2] == [[10, 11], []] and tables[2:] == [[v] for v in values[2:]]
    assert histories[:2] == [[9, 9, 9, 10, 11], [9, 9, 9]]
    assert histories[2:] == [[9, 9, 9, v] for v in values[2:]]
    assert state.digest == state.recompute_digest()
