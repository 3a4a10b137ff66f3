"""EngineMirror, focused scenarios: steady-state cost, prefixes, id reuse, updates, preemption.

Every step goes engine → ``codec`` → a real ``WorkerReplica``, and the worker's
rebuilt request must equal the engine's (``requests_equal``); the mirror runs with
``verify=True`` too.  Byte budgets are the protocol's promises (issue "What must
be shown"); the measured values are noted beside them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from engine_side.diffing import BlockHint
from engine_side.mirror import PREFIX_MIN_TOKENS, EngineMirror
from protocol import codec
from protocol.errors import LocalProtocolError
from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER, Delta, DeltaBody
from protocol.packing import unpack_uints
from protocol.params import SamplingSpec
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, requests_equal
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
    """An engine mirror and one worker replica joined by the codec."""

    token_mode: int = TOKEN_MODE_WORKER
    check: bool = True  # compare every rebuilt request (O(batch) deep equality per step)
    mirror: EngineMirror = field(init=False)
    replica: WorkerReplica = field(default_factory=WorkerReplica)

    def __post_init__(self) -> None:
        self.mirror = EngineMirror(token_mode=self.token_mode, verify=self.check)
        self.replica.receive(codec.decode(codec.encode(self.mirror.snapshot())), 0.0)

    def step(self, rows: list[Row], **extra: tuple[str, ...]) -> tuple[Delta, int]:
        """Diff one step, ship it, check the worker rebuilt it; returns (delta, wire bytes)."""
        request = batch(rows, **extra)
        frames = codec.encode(self.mirror.diff(request))
        delta = codec.decode(frames)
        assert isinstance(delta, Delta)
        assert self.replica.receive(delta, 0.0) == [ev.Applied(delta.seq)]
        assert not self.check or requests_equal(self.replica.request(), request)
        return delta, codec.encoded_size(frames)


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
def test_steady_decode_is_an_empty_body(n: int) -> None:
    pair, rows = Pair(check=n <= 256), prefill(n)
    pair.step(rows)
    decode_step(rows)
    pair.step(rows)  # scheduled counts change 12 -> 1: the last non-steady step
    for _ in range(3):
        decode_step(rows)
        delta, size = pair.step(rows)
        assert delta.body == DeltaBody()
        assert size <= 32  # measured: 16 bytes at every batch size
    assert requests_equal(pair.replica.request(), batch(rows))


def test_engine_tokens_one_token_per_request_and_a_block_per_16() -> None:
    pair, rows = Pair(TOKEN_MODE_ENGINE), prefill(256, tokens=True)
    rng = np.random.default_rng(1)
    pair.step(rows)
    next_block = 10_000
    for step in range(3):
        decode_step(rows)
        for i, r in enumerate(rows):
            assert r.tokens is not None
            r.tokens.append(int(rng.integers(VOCAB - 16, VOCAB)))  # 17-bit token ids
            if i % 16 == step % 16:
                r.blocks = [*r.blocks, next_block]
                next_block += 1
        delta, size = pair.step(rows)
        if step:  # after the first step the scheduled counts are steady
            assert delta.body.tokens is not None and delta.body.block_append
            assert size <= 900  # measured: 641 bytes


# ---------------------------------------------------------------- prefix references


def test_prefix_reference_for_a_live_prompt_only() -> None:
    pair = Pair()
    shared = list(range(1000, 1000 + PREFIX_MIN_TOKENS + 4))
    a = Row(spec("a", shared), 20, 0, [1, 2])
    pair.step([a])
    b = Row(spec("b", shared[:18] + [7, 8, 9]), 21, 0, [3, 4])
    delta, _ = pair.step([a, b])
    (add,) = delta.body.added
    assert add.prefix_handle >= 0 and add.prefix == 18
    assert unpack_uints(add.prompt).tolist() == [7, 8, 9]  # only the suffix travels
    # once "a" and "b" are finished, a third prompt sharing the prefix carries it whole
    pair.step([], finished=("a", "b"))
    c = Row(spec("c", shared + [5]), 21, 0, [5])
    delta, _ = pair.step([c])
    assert delta.body.added[0].prefix_handle == -1
    assert unpack_uints(delta.body.added[0].prompt).tolist() == shared + [5]


def test_no_prefix_reference_to_a_request_finished_in_the_same_step() -> None:
    pair = Pair()
    shared = list(range(PREFIX_MIN_TOKENS + 2))
    pair.step([Row(spec("a", shared), 18, 0, [1])])
    delta, _ = pair.step([Row(spec("b", shared), 18, 0, [2])], finished=("a",))
    assert delta.body.added[0].prefix_handle == -1


# ---------------------------------------------------------------- lifecycle edge cases


def test_finished_and_readded_in_the_same_step() -> None:
    pair = Pair()
    pair.step([Row(spec("x", [1, 2, 3]), 3, 0, [1])])
    again = Row(spec("x", [4, 5, 6, 7], temperature=0.0), 4, 0, [9])
    delta, _ = pair.step([again], finished=("x",))
    assert delta.body.finished and len(delta.body.added) == 1
    assert pair.replica.request().specs[0].sampling == SamplingSpec(temperature=0.0)
    assert pair.replica.request().finished_req_ids == frozenset({"x"})


def test_update_same_id_new_spec() -> None:
    pair = Pair()
    row = Row(spec("u", [1, 2, 3]), 3, 0, [1])
    pair.step([row])
    decode_step([row])
    row.spec = spec("u", [1, 2, 3], max_tokens=99)
    delta, _ = pair.step([row])
    assert not delta.body.finished and delta.body.added[0].req_id == "u"
    assert pair.replica.request().specs[0].sampling == SamplingSpec(max_tokens=99)


def test_preempt_then_resume_with_a_replaced_block_table() -> None:
    pair = Pair()
    a, b = Row(spec("a", [1] * 8), 8, 0, [1, 2]), Row(spec("b", [2] * 8), 8, 0, [3, 4])
    pair.step([a, b])
    decode_step([a, b])
    pair.step([a], preempted=("b",))  # b loses its blocks but stays live
    decode_step([a])
    b.computed, b.scheduled, b.blocks = 0, 9, [7, 8, 9]
    delta, _ = pair.step([a, b], resumed=("b",))
    assert delta.body.block_replace and not delta.body.added  # no re-add, a new table
    assert pair.replica.request().resumed_req_ids == frozenset({"b"})


def test_misaligned_columns_leave_the_mirror_unchanged() -> None:
    pair, rows = Pair(), prefill(3)
    pair.step(rows)
    digest, seq = pair.mirror.state.digest, pair.mirror.seq
    decode_step(rows)
    bad = batch(rows)
    bad.num_scheduled_tokens = bad.num_scheduled_tokens[:2]
    with pytest.raises(LocalProtocolError):
        pair.mirror.diff(bad)
    assert (pair.mirror.state.digest, pair.mirror.seq) == (digest, seq)
    pair.step(rows)  # the next valid step still applies on the worker


# ---------------------------------------------------------------- rebuilt containers


def test_rebuilt_containers_are_fresh() -> None:
    pair, rows = Pair(), prefill(4)
    pair.step(rows)
    decode_step(rows)
    request = batch(rows)
    pair.step(rows)
    first = pair.replica.data.rebuild()  # type: ignore[union-attr]
    with pytest.raises(ValueError):  # block tables are shared read-only, never edited
        first.block_tables[0].values[:] = -1
    with pytest.raises(ValueError):
        first.block_tables[0].lengths[:] = -1
    first.num_computed_tokens[:] = -1
    with pytest.raises(ValueError):
        first.num_scheduled_tokens[:] = -1
    first.req_ids.append("intruder")
    assert requests_equal(pair.replica.data.rebuild(), request)  # type: ignore[union-attr]


def test_output_token_rows_are_read_only_views() -> None:
    pair, rows = Pair(TOKEN_MODE_ENGINE), prefill(2, tokens=True)
    pair.step(rows)
    decode_step(rows)
    for r in rows:
        r.tokens = [5, 6]
    pair.step(rows)
    out = pair.replica.request().output_token_ids
    assert out is not None
    for row in out:
        assert not row.flags.writeable
        with pytest.raises(ValueError):
            row[0] = 0
    decode_step(rows)
    for r in rows:
        r.tokens = [5, 6, 7]
    pair.step(rows)
    assert [row.tolist() for row in out] == [[5, 6], [5, 6]]  # earlier views never change


# ---------------------------------------------------------------- block hints


def _hinted_and_plain(steps: list[tuple[ExecuteModelRequest, BlockHint | None]]) -> None:
    """Each step diffed by two mirrors, one given the hint: the same bodies, and the
    hinted mirror's state rebuilds the request (verify)."""
    hinted, plain = EngineMirror(verify=True), EngineMirror(verify=True)
    for request, hint in steps:
        assert hinted.diff(request, hint).body == plain.diff(request).body


def test_block_hints_give_the_bodies_of_a_whole_table_diff() -> None:
    """Rows that left, a kept row growing, rows joining at the end (new, and one the
    mirror holds that grew while away), and a hint whose kept row restarts (ignored)."""
    rows = prefill(4)
    steps: list[tuple[ExecuteModelRequest, BlockHint | None]] = [(batch(rows), None)]
    decode_step(rows)
    away = rows.pop(1)  # scheduled again later, its table grown meanwhile
    rows[1].blocks = [*rows[1].blocks, 70, 71]
    steps.append((batch(rows), BlockHint(3, ([1],), ([2],))))
    decode_step(rows)
    away.blocks, away.computed, away.scheduled = [*away.blocks, 80], away.computed + 1, 1
    joined = Row(spec("new", [5, 6, 7]), 3, 0, [90, 91])
    rows[0].blocks = [*rows[0].blocks, 72]
    steps.append((batch([*rows, away, joined]), BlockHint(3, ([0],), ([1],))))
    decode_step([*rows, away, joined])
    rows[2].spec = spec(rows[2].spec.req_id, [1, 2, 3], max_tokens=7)  # an update: restarts
    rows[2].blocks = [*rows[2].blocks, 73]
    steps.append((batch([*rows, away, joined]), BlockHint(5, ([2],), ([1],))))
    decode_step([*rows, away, joined])
    rows[0].blocks, rows[1].blocks = [*rows[0].blocks, 74, 75], [*rows[1].blocks, 76]
    away.blocks = [98, 99]  # replaced while away: a replacement past the kept rows
    steps.append((batch([rows[0], rows[1], away, joined]), BlockHint(2, ([0, 1],), ([2, 1],))))
    _hinted_and_plain(steps)
