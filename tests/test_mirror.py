"""EngineMirror and RequestDiffer, focused scenarios: steady-state cost, id reuse, updates,
preemption, refusals, fresh rebuilt containers.

Every step goes engine → ``codec`` → a real ``WorkerReplica``; the request the worker
rebuilds (``rebuild_request`` of its state, the oracle) must equal the engine's, and so
must the one rebuilt from the mirror's own state.  Byte budgets are the protocol's
promises; the measured values are noted beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from oracle import Oracle, replica_request, state_fingerprint

from engine_side.mirror import EngineMirror, Entry
from engine_side.workloads import Workload
from protocol import codec
from protocol.errors import LocalProtocolError
from protocol.messages import (
    EMPTY_BODY,
    TOKEN_MODE_ENGINE,
    TOKEN_MODE_WORKER,
    Delta,
    Spec,
)
from protocol.packing import pack_uints
from protocol.params import SamplingSpec
from protocol.rebuild import rebuild_request
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, requests_equal
from protocol.state import ReplicaState
from worker_side import events as ev
from worker_side.replica import WorkerReplica

VOCAB = 128256


def spec(req_id: str, prompt: list[int] | np.ndarray, **sampling: object) -> RequestSpec:
    tokens = np.asarray(prompt, dtype=np.int64)
    tokens.flags.writeable = False
    return RequestSpec(req_id, tokens, SamplingSpec(**sampling))  # type: ignore[arg-type]


@dataclass
class Row:
    """One scheduled request as the engine's scheduler sees it this step."""

    spec: RequestSpec
    scheduled: int
    computed: int
    blocks: list[int]
    tokens: list[int] | None = None


@dataclass
class Pair:
    """An engine mirror (diffing whole requests) and one worker replica joined by the codec."""

    token_mode: int = TOKEN_MODE_WORKER
    check: bool = True  # compare every rebuilt request (O(batch) deep equality per step)
    oracle: Oracle = field(init=False)
    replica: WorkerReplica = field(default_factory=WorkerReplica)

    def __post_init__(self) -> None:
        self.oracle = Oracle(token_mode=self.token_mode, check=self.check)
        self.replica.receive(codec.decode(codec.encode(self.mirror.snapshot())), 0.0)
        self.cache: dict = {}

    @property
    def mirror(self) -> EngineMirror:
        return self.oracle.mirror

    def step(self, rows: list[Row], **extra: tuple[str, ...]) -> tuple[Delta, int]:
        """Diff one step, ship it, check the worker rebuilt it; returns (delta, wire bytes)."""
        request = batch(rows, **extra)
        frames = codec.encode(self.oracle.diff(request))
        delta = codec.decode(frames)
        assert isinstance(delta, Delta)
        assert self.replica.receive(delta, 0.0) == [ev.Applied(delta.seq)]
        assert not self.check or requests_equal(self.request(), request)
        return delta, codec.encoded_size(frames)

    def request(self) -> ExecuteModelRequest:
        """The request the worker rebuilds for the step it just applied."""
        return replica_request(self.replica, self.cache)


def batch(rows: list[Row], finished: tuple[str, ...] = (), preempted: tuple[str, ...] = (),
          resumed: tuple[str, ...] = ()) -> ExecuteModelRequest:
    n = len(rows)
    engine_tokens = any(r.tokens is not None for r in rows)
    return ExecuteModelRequest(
        req_ids=[r.spec.req_id for r in rows], specs=[r.spec for r in rows],
        num_scheduled_tokens=np.array([r.scheduled for r in rows], dtype=np.int64),
        num_computed_tokens=np.array([r.computed for r in rows], dtype=np.int64),
        block_tables=(Ragged.from_lists([r.blocks for r in rows]),),
        spec_token_ids=Ragged.empty(n), encoder_inputs=Ragged.empty(n),
        output_token_ids=[np.array(r.tokens, dtype=np.int64) for r in rows]
        if engine_tokens else None,
        finished_req_ids=frozenset(finished), preempted_req_ids=frozenset(preempted),
        resumed_req_ids=frozenset(resumed),
    )


def decode_step(rows: list[Row]) -> None:
    """Advance every row by one decode step (the scheduler's bookkeeping)."""
    for r in rows:
        r.computed += r.scheduled
        r.scheduled = 1


def prefill(n: int, tokens: bool = False, seed: int = 0) -> list[Row]:
    rng = np.random.default_rng(seed)
    return [Row(spec(f"req-{i}", rng.integers(0, VOCAB, 12)), 12, 0, [2 * i, 2 * i + 1],
                [] if tokens else None) for i in range(n)]


# ---------------------------------------------------------------- steady state


@pytest.mark.parametrize("n", [1, 256, 4096])
def test_steady_decode_is_an_empty_body_of_14_bytes(n: int) -> None:
    pair, rows = Pair(check=n <= 256), prefill(n)
    pair.step(rows)
    decode_step(rows)
    pair.step(rows)  # scheduled counts change 12 -> 1: the last non-steady step
    for _ in range(3):
        decode_step(rows)
        delta, size = pair.step(rows)
        assert delta.body == EMPTY_BODY
        assert size == 14  # [tag, epoch, seq, digest (9 bytes), {}]
    assert requests_equal(pair.request(), batch(rows))


def test_steady_decode_through_the_step_api_is_an_empty_body() -> None:
    """``EngineMirror.step`` with the batch, counts and computed counts as predicted (what
    an engine that knows its changes passes) writes the empty body too."""
    workload = Workload("steady_decode", 64, seed=2)
    mirror = EngineMirror(token_mode=workload.token_mode)
    for _ in workload.warmup():
        mirror.step(**workload.changes)
    for _ in range(4):
        workload.step()
        delta, _ = mirror.step(**workload.changes)
        assert delta.body == EMPTY_BODY and len(codec.encode(delta)[0]) == 14


def test_engine_tokens_one_token_per_request_and_a_block_per_16() -> None:
    """Workload "decode_tokens_blocks" at batch 256 through ``EngineMirror.step`` with the
    workload's own changes: at most 900 bytes a step (measured: 631-633), and a worker fed
    those deltas rebuilds the workload's requests exactly."""
    workload = Workload("decode_tokens_blocks", 256, seed=1)
    mirror = EngineMirror(token_mode=workload.token_mode)
    worker = ReplicaState(workload.token_mode)
    cache: dict = {}

    def step(request: ExecuteModelRequest) -> tuple[Delta, int]:
        delta, _ = mirror.step(**workload.changes)
        frames = codec.encode(delta)
        got = codec.decode(frames)
        assert isinstance(got, Delta)
        applied = worker.apply(got.body, got.digest)
        assert requests_equal(rebuild_request(worker, got.body, applied, cache), request)
        return got, codec.encoded_size(frames)

    for request in workload.warmup():
        step(request)
    sizes = []
    for _ in range(16):
        delta, size = step(workload.step())
        assert delta.body.tokens is not None and delta.body.block_append
        sizes.append(size)
    assert max(sizes) <= 900, sizes


# ---------------------------------------------------------------- lifecycle edge cases


def test_finished_and_readded_in_the_same_step() -> None:
    """The same id ends and joins again in one step: the old entry ends (its id is in
    finished_req_ids), the new one starts fresh -- its own spec and table, nothing of
    the old one's carried."""
    pair = Pair()
    pair.step([Row(spec("x", [1, 2, 3]), 3, 0, [1, 2])])
    again = Row(spec("x", [4, 5, 6, 7], temperature=0.0), 4, 0, [9])
    delta, _ = pair.step([again], finished=("x",))
    assert delta.body.finished and len(delta.body.added) == 1
    request = pair.request()
    assert request.specs[0].sampling == SamplingSpec(temperature=0.0)
    assert request.finished_req_ids == frozenset({"x"})
    assert request.block_tables[0].to_lists() == [[9]]
    assert request.num_computed_tokens.tolist() == [0]


def test_update_same_id_new_spec() -> None:
    """A live id sent with a new spec is an add that replaces the entry (no finish)."""
    pair = Pair()
    row = Row(spec("u", [1, 2, 3]), 3, 0, [1])
    pair.step([row])
    decode_step([row])
    row.spec = spec("u", [1, 2, 3], max_tokens=99)
    delta, _ = pair.step([row])
    assert not delta.body.finished and len(delta.body.added) == 1
    assert pair.request().specs[0].sampling == SamplingSpec(max_tokens=99)
    assert pair.request().finished_req_ids == frozenset()


def test_preempt_then_resume_with_a_replaced_block_table() -> None:
    pair = Pair()
    a, b = Row(spec("a", [1] * 8), 8, 0, [1, 2]), Row(spec("b", [2] * 8), 8, 0, [3, 4])
    pair.step([a, b])
    decode_step([a, b])
    pair.step([a], preempted=("b",))  # b leaves the batch but stays live
    assert pair.request().preempted_req_ids == frozenset({"b"})
    decode_step([a])
    b.computed, b.scheduled, b.blocks = 0, 9, [7, 8, 9]
    delta, _ = pair.step([a, b], resumed=("b",))
    assert delta.body.rare.block_replace and not delta.body.added  # no re-add, a new table
    assert pair.request().resumed_req_ids == frozenset({"b"})
    assert pair.request().block_tables[0].to_lists() == [a.blocks, [7, 8, 9]]


def test_misaligned_columns_leave_the_mirror_unchanged() -> None:
    pair, rows = Pair(), prefill(3)
    pair.step(rows)
    before = (state_fingerprint(pair.mirror.state), pair.mirror.seq, dict(pair.mirror.ids))
    decode_step(rows)
    bad = batch(rows)
    bad.num_scheduled_tokens = bad.num_scheduled_tokens[:2]
    with pytest.raises(LocalProtocolError):
        pair.oracle.diff(bad)
    assert (state_fingerprint(pair.mirror.state), pair.mirror.seq, dict(pair.mirror.ids)) \
        == before
    pair.step(rows)  # the next valid step still applies on the worker


@pytest.mark.parametrize("case", ["counts", "computed", "finished_scheduled", "unknown_id",
                                  "bad_position", "groups"])
def test_an_inconsistent_step_is_refused_and_the_mirror_unchanged(case: str) -> None:
    """``EngineMirror.step`` raises LocalProtocolError for a step that does not fit its
    state -- counts or computed counts not one per batch row, a request both finished
    and scheduled (vLLM never schedules what it finishes), an id that is not live, a
    block row outside the batch, rows for another number of KV groups -- and then
    holds exactly what it held: the next valid step applies."""
    mirror = EngineMirror()
    specs = [Spec(req_id=r, prompt=pack_uints([1, 2])) for r in "abc"]
    mirror.step(["a", "b", "c"], [2, 2, 2], added=[Entry(s) for s in specs])
    before = (state_fingerprint(mirror.state), mirror.seq, dict(mirror.ids), mirror.batch)
    cases: dict[str, dict[str, Any]] = {
        "counts": {"nsched": [1, 1]}, "computed": {"computed": [2, 2]},
        "finished_scheduled": {"finished": ["b"]}, "unknown_id": {"batch": ["a", "b", "zzz"]},
        "bad_position": {"appends": [([3], [1], [5])]},
        "groups": {"appends": [([0], [1], [5]), ([0], [1], [6])]}}
    step = {"batch": ["a", "b", "c"], "nsched": [1, 1, 1], **cases[case]}
    with pytest.raises(LocalProtocolError):
        mirror.step(step.pop("batch"), step.pop("nsched"), **step)
    assert (state_fingerprint(mirror.state), mirror.seq, dict(mirror.ids), mirror.batch) \
        == before
    delta, _ = mirror.step(["a", "b", "c"], [1, 1, 1])
    assert delta.seq == 2 and mirror.state.digest == mirror.state.recompute_digest()


def test_a_handle_freed_by_a_finish_is_reused_from_the_next_step() -> None:
    mirror = EngineMirror()
    specs = {r: Spec(req_id=r, prompt=pack_uints([1, 2])) for r in "abcd"}
    mirror.step(["a", "b"], [1, 1], added=[Entry(specs["a"]), Entry(specs["b"])])
    assert mirror.ids == {"a": 0, "b": 1}
    mirror.step(["b", "c"], [1, 1], finished=["a"], added=[Entry(specs["c"])])
    assert mirror.ids == {"b": 1, "c": 2}  # a's handle is not reused in its finishing step
    mirror.step(["b", "c", "d"], [1, 1, 1], added=[Entry(specs["d"])])
    assert mirror.ids == {"b": 1, "c": 2, "d": 0}


def test_a_differ_forgets_its_specs_when_the_mirror_moves_without_it() -> None:
    """Steps the engine takes straight through ``mirror.step`` (its known changes) between
    diffs: a handle freed and reused there holds another spec, so the differ's memory of
    the spec object it last saw for that handle must not be trusted."""
    from protocol.rebuild import wire_spec

    pair, rows = Pair(), prefill(2)
    pair.step(rows)  # req-0 -> handle 0, req-1 -> handle 1, through the differ
    old = rows[0].spec
    other = spec(old.req_id, [7, 7, 7])  # the same id, another prompt
    for kwargs in ({"finished": [old.req_id]},
                   {"added": [Entry(wire_spec(other)[0])]}):  # handle 0 again
        batch_ids = [rows[1].spec.req_id] + ([old.req_id] if "added" in kwargs else [])
        delta, _ = pair.mirror.step(batch_ids, [1] * len(batch_ids), **kwargs)  # type: ignore[arg-type]
        assert pair.replica.receive(codec.decode(codec.encode(delta)), 0.0) \
            == [ev.Applied(delta.seq)]
    assert pair.mirror.ids[old.req_id] == 0
    rows = [rows[1], Row(old, 1, 0, [9])]  # the engine's request names the old spec again
    pair.step(rows)  # rebuilt at both ends equal to it: the differ re-sent the spec


# ---------------------------------------------------------------- rebuilt containers


def test_rebuilt_containers_are_fresh() -> None:
    pair, rows = Pair(), prefill(4)
    pair.step(rows)
    decode_step(rows)
    request = batch(rows)
    pair.step(rows)
    first = pair.request()
    for column in (first.block_tables[0].values, first.block_tables[0].lengths,
                   first.num_computed_tokens, first.num_scheduled_tokens):
        column[:] = -1  # the caller's to edit: nothing it holds aliases the state
    first.req_ids.append("intruder")
    first.specs.clear()
    assert requests_equal(pair.request(), request)
    assert pair.replica.data is not None
    assert pair.replica.data.digest == pair.replica.data.recompute_digest()


def test_output_token_rows_never_change_once_handed_out() -> None:
    pair, rows = Pair(TOKEN_MODE_ENGINE), prefill(2, tokens=True)
    pair.step(rows)
    decode_step(rows)
    for r in rows:
        r.tokens = [5, 6]
    pair.step(rows)
    out = pair.request().output_token_ids
    assert out is not None
    decode_step(rows)
    for r in rows:
        r.tokens = [5, 6, 7]
    pair.step(rows)
    decode_step(rows)
    for r in rows:
        r.tokens = [5, 8]  # a truncation and a different token where 6 was
    pair.step(rows)
    assert [row.tolist() for row in out] == [[5, 6], [5, 6]]  # earlier rows never change


def test_appends_to_rows_ending_at_one_offset_rebuild_in_batch_order() -> None:
    """Appends naming a row and the empty row after it (both end at one offset), the later
    row first: each block lands in its own row."""
    pair = Pair()
    rows = [Row(spec(f"r{i}", [i] * 4), 4, 0, [i] * (i % 3)) for i in range(4)]
    pair.step(rows)  # rows of 0, 1, 2 and 0 blocks
    decode_step(rows)
    rows[3].blocks = [*rows[3].blocks, 76]
    rows[2].blocks = [*rows[2].blocks, 97]
    pair.step(rows)
    assert pair.request().block_tables[0].to_lists() == [[], [1], [2, 2, 97], [76]]


@pytest.mark.parametrize("capacity", [64, 128])  # the columns' first sizes
def test_a_join_past_the_columns_capacity_in_a_step_with_tokens(capacity: int) -> None:
    """Engine tokens: a request joins under the first handle past the state's columns
    while the others get tokens (and one a truncation) -- the engine and a worker both
    apply it (found by the stateful test: the token lengths were read before the
    columns grew)."""
    mirror = EngineMirror(token_mode=TOKEN_MODE_ENGINE)
    worker = ReplicaState(TOKEN_MODE_ENGINE)
    ids = [f"r{i}" for i in range(capacity)]

    def step(batch: list[str], **kwargs: object) -> None:
        delta, _ = mirror.step(batch, [1] * len(batch), **kwargs)  # type: ignore[arg-type]
        got = codec.decode(codec.encode(delta))
        assert isinstance(got, Delta)
        worker.apply(got.body, got.digest)
        assert worker.digest == worker.recompute_digest()

    step(ids, added=[Entry(Spec(req_id=r, prompt=pack_uints([1])), 0, [5, 6]) for r in ids])
    late = Spec(req_id="late", prompt=pack_uints([2]))
    step([*ids, "late"], added=[Entry(late, 0, [7])],
         tokens=(list(range(capacity)), [1] * capacity, [9] * capacity),
         truncate=([0], [1]))
    assert mirror.ids["late"] == capacity
    assert worker.token_history(capacity).tolist() == [7]
    assert worker.token_history(0).tolist() == [5, 9]


def test_a_spec_without_prompt_ids_or_prompt_none_is_refused_unchanged() -> None:
    """Every receiver refuses such a spec (SPEC §6.2), so the mirror must not send it."""
    mirror = EngineMirror()
    with pytest.raises(LocalProtocolError):
        mirror.step(["a"], [1], added=[Entry(Spec(req_id="a"))])
    assert mirror.seq == 0 and mirror.ids == {} and mirror.state.digest == 0
