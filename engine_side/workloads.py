"""Synthetic continuous-batching workloads: a stream of ``ExecuteModelRequest``s.

A :class:`Workload` plays a vLLM-like scheduler over a seeded RNG: it keeps up
to ``batch`` live requests in numpy columns indexed by *slot*, schedules them in
arrival order (vLLM's running list), allocates KV blocks of ``block_size`` tokens
from a shuffled free pool, samples tokens from ``vocab`` and emits one full
request per step.  Per-step work is vectorised over slots, so a 4096-request
step costs a few milliseconds.

Contract of every emitted request (what the mirror relies on):

* a request appears in ``req_ids`` before it can finish; its
  :class:`RequestSpec` is created once and the *same object* is emitted every
  step; finished ids appear in ``finished_req_ids`` of the following step;
* ``num_computed_tokens`` advances by last step's ``num_scheduled_tokens``
  (minus rejected drafts in speculative decoding);
* block tables only grow while a request lives; ``output_token_ids`` rows
  (engine-token scenarios) are read-only views whose visible prefix never changes.

Requests arrive with a prompt of a few hundred tokens and some output history
already generated (their first step is a prefill of prompt + history, as after a
recompute), so a steady state is reached after one prefill and a few decodes.
Scenarios are data (:class:`Scenario`); add one by adding an entry to
``SCENARIOS``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER
from protocol.params import SamplingSpec
from protocol.request import ExecuteModelRequest, IntArray, Ragged, RequestSpec

VOCAB = 128256  # Llama 3
BLOCK_SIZE = 16
_NEVER = 1 << 30  # an output length no request reaches


@dataclass(frozen=True)
class Scenario:
    """How a workload behaves; every knob defaults to "off"."""

    name: str
    description: str
    engine_tokens: bool = False  # engine sends sampled tokens (v0 / pipeline parallel)
    reserve_tokens: int = 0  # blocks for this many decode tokens are allocated at admission
    finish_rate: float = 0.0  # per-step chance a decoding request finishes (a new one replaces it)
    prefill_chunk: int = 0  # max prompt tokens per request per step (0: whole prefill at once)
    spec_tokens: int = 0  # draft tokens per decoding request (speculative decoding)
    shared_prefix: int = 0  # tokens of a system prompt shared by every prompt


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("steady_decode", "worker-owned tokens, one token per request, no new blocks "
             "(for 256 steps)", reserve_tokens=256),
    Scenario("decode_tokens_blocks", "engine-sent tokens, one new token per request, "
             "one new block per 16 requests", engine_tokens=True),
    Scenario("mixed_chat", "arrivals and finishes, chunked prefill, shared system prompt",
             finish_rate=0.02, prefill_chunk=256, shared_prefix=64),
    Scenario("spec_decode", "3 draft tokens per request, a random number accepted",
             spec_tokens=3),
)}


def request_id(rng: np.random.Generator) -> str:
    """An id shaped like vLLM's OpenAI server's: ``chatcmpl-<16 hex>-<8 hex>`` (34 chars)."""
    return f"chatcmpl-{rng.bytes(8).hex()}-{rng.bytes(4).hex()}"


class Workload:
    """A seeded scheduler producing one ``ExecuteModelRequest`` per :meth:`step`.

    Args:
        scenario: a :class:`Scenario` or the name of one in ``SCENARIOS``.
        batch: live requests (all admitted in the first step, refilled after finishes).
        seed: RNG seed; the same seed gives the same stream.
        prompt_tokens: (low, high) prompt length range.
        history_tokens: (low, high) output tokens already generated at arrival.
        headroom: decode steps a request can take before it must finish.
    """

    def __init__(self, scenario: Scenario | str, batch: int, *, seed: int = 0,
                 vocab: int = VOCAB, block_size: int = BLOCK_SIZE,
                 prompt_tokens: tuple[int, int] = (192, 512),
                 history_tokens: tuple[int, int] = (16, 128), headroom: int = 512) -> None:
        self.scenario = SCENARIOS[scenario] if isinstance(scenario, str) else scenario
        self.batch, self.vocab, self.block_size = batch, vocab, block_size
        self.rng = np.random.default_rng(seed)
        self.prompt_range, self.history_range = prompt_tokens, history_tokens
        self.max_out = history_tokens[1] + 16 + headroom * (1 + self.scenario.spec_tokens)
        max_len = prompt_tokens[1] + self.max_out + 2 * block_size
        self.max_blocks = -(-max_len // block_size)
        self._alloc_columns()
        pool = self.rng.permutation(batch * self.max_blocks + 1024).astype(np.int64)
        self.free_blocks = list(pool.tolist())
        self.system_prompt = self.rng.integers(0, vocab, self.scenario.shared_prefix)
        self.finished: list[str] = []
        self.steps = 0
        self._table: Ragged | None = None  # the last emitted block table (reused while valid)
        self._table_order: IntArray = np.zeros(0, dtype=np.int64)
        #: this step's changes as the engine knows them (``EngineMirror.step`` arguments):
        #: new blocks and new tokens per slot since the last step, slots admitted
        self.changes: dict[str, Any] = {}
        self._grown: dict[int, list[int]] = {}
        self._sampled: dict[int, list[int]] = {}
        self._admitted: list[int] = []

    def _alloc_columns(self) -> None:
        n = self.batch
        self.ids: list[str] = [""] * n
        self.specs: list[RequestSpec | None] = [None] * n
        self.order: list[int] = []  # slots in batch (arrival) order
        self.live = np.zeros(n, dtype=bool)
        self.prefill_target = np.zeros(n, dtype=np.int64)  # prompt + history at arrival
        self.computed = np.zeros(n, dtype=np.int64)
        self.out_len = np.zeros(n, dtype=np.int64)
        self.nblocks = np.zeros(n, dtype=np.int64)
        self.blocks = np.zeros((n, self.max_blocks), dtype=np.int32)  # block ids < 2**31
        width = self.max_out if self.scenario.engine_tokens else 1
        self.tokens = np.zeros((n, width), dtype=np.int64)

    @property
    def token_mode(self) -> int:
        return TOKEN_MODE_ENGINE if self.scenario.engine_tokens else TOKEN_MODE_WORKER

    # -- the step ------------------------------------------------------------------------
    def step(self) -> ExecuteModelRequest:
        """Schedule, allocate, emit the request, then run the "model" (advance state)."""
        finished, self.finished = self.finished, []
        self._admit()
        order = np.asarray(self.order, dtype=np.int64)
        nsched, drafts = self._plan(order)
        self._allocate(order, nsched)
        req = self._request(order, nsched, drafts, finished)
        self.changes = self._changes(req, order)
        self._advance(order, nsched)
        self._finish(order)
        self.steps += 1
        return req

    def warmup(self, decode_steps: int = 3) -> Iterator[ExecuteModelRequest]:
        """Steps until every request has prefilled, then ``decode_steps`` more."""
        yield self.step()
        chunk = self.scenario.prefill_chunk or _NEVER
        for _ in range(-(-int(self.prefill_target.max()) // chunk) - 1):
            yield self.step()
        for _ in range(decode_steps):
            yield self.step()

    # -- admission -------------------------------------------------------------------------
    def _admit(self) -> None:
        free = np.flatnonzero(~self.live)
        if not free.size:
            return
        first = self.steps == 0
        if self.scenario.engine_tokens and not first:
            self.tokens = self.tokens.copy()  # rows handed out earlier never change
        for rank, slot in enumerate(free.tolist()):
            self._new_request(slot, phase=rank if first else None)
        self.order.extend(free.tolist())
        self._admitted = free.tolist()

    def _new_request(self, slot: int, phase: int | None) -> None:
        """Fill ``slot``; ``phase`` staggers prompt+history lengths mod the block size."""
        rng, sc = self.rng, self.scenario
        plen = int(rng.integers(*self.prompt_range))
        hist = int(rng.integers(*self.history_range))
        if phase is not None:  # block boundaries spread evenly over the batch
            hist += (phase - plen - hist) % self.block_size
        prompt = rng.integers(0, self.vocab, plen)
        prompt[: sc.shared_prefix] = self.system_prompt[: min(plen, sc.shared_prefix)]
        prompt.flags.writeable = False
        req_id = request_id(rng)
        self.ids[slot] = req_id
        self.specs[slot] = RequestSpec(req_id, prompt, _sampling(rng))
        self.live[slot] = True
        self.prefill_target[slot] = plen + hist
        self.computed[slot] = 0
        self.out_len[slot] = hist
        self.nblocks[slot] = 0
        if sc.engine_tokens:
            self.tokens[slot, :hist] = rng.integers(0, self.vocab, hist)
        if sc.reserve_tokens:
            need = -(-(plen + hist + sc.reserve_tokens) // self.block_size)
            self._grow(np.array([slot]), np.array([min(need, self.max_blocks)]))

    # -- scheduling and blocks --------------------------------------------------------------
    def _plan(self, order: IntArray) -> tuple[IntArray, Ragged]:
        remaining = self.prefill_target[order] - self.computed[order]
        prefilling = remaining > 0
        chunk = self.scenario.prefill_chunk or _NEVER
        k = self.scenario.spec_tokens
        nsched = np.where(prefilling, np.minimum(remaining, chunk), 1 + k)
        lengths = np.where(prefilling, 0, k).astype(np.int64)
        values = self.rng.integers(0, self.vocab, int(lengths.sum()))
        return nsched.astype(np.int64), Ragged(lengths, values)

    def _allocate(self, order: IntArray, nsched: IntArray) -> None:
        need = -(-(self.computed[order] + nsched) // self.block_size)
        grow = need > self.nblocks[order]
        if grow.any():
            self._grow(order[grow], need[grow])

    def _grow(self, slots: IntArray, need: IntArray) -> None:
        """Give each slot new blocks from the free pool up to ``need`` blocks (vectorised)."""
        have = self.nblocks[slots]
        count = int((need - have).sum())
        if count > len(self.free_blocks):
            raise RuntimeError("workload ran out of KV blocks")
        taken = np.asarray(self.free_blocks[-count:], dtype=np.int64)
        del self.free_blocks[-count:]
        rows = np.repeat(slots, need - have)
        starts = np.repeat(have - np.cumsum(need - have) + (need - have), need - have)
        self.blocks[rows, starts + np.arange(count)] = taken
        self.nblocks[slots] = need
        for slot, block in zip(rows.tolist(), taken.tolist(), strict=True):
            self._grown.setdefault(slot, []).append(block)
        self._table = None  # tables changed

    # -- emitting ----------------------------------------------------------------------------
    def _request(self, order: IntArray, nsched: IntArray, drafts: Ragged,
                 finished: list[str]) -> ExecuteModelRequest:
        slots = order.tolist()
        if self._table is None or not np.array_equal(self._table_order, order):
            nblocks = self.nblocks[order]
            values = self.blocks[order][np.arange(self.max_blocks) < nblocks[:, None]]
            # like an engine keeping its block tables: the same object while unchanged
            self._table, self._table_order = Ragged(nblocks, values), order
        tokens = None
        if self.scenario.engine_tokens:
            rows, lens = self.tokens, self.out_len[order].tolist()
            tokens = [_frozen(rows[s, :n]) for s, n in zip(slots, lens, strict=True)]
        return ExecuteModelRequest(
            req_ids=[self.ids[s] for s in slots],
            specs=[self.specs[s] for s in slots],  # type: ignore[misc]
            num_scheduled_tokens=nsched,
            num_computed_tokens=self.computed[order],
            block_tables=(self._table,),
            spec_token_ids=drafts,
            encoder_inputs=Ragged.empty(order.size),
            output_token_ids=tokens,
            finished_req_ids=frozenset(finished),
        )

    def _changes(self, req: ExecuteModelRequest, order: IntArray) -> dict[str, Any]:
        """The step as :meth:`engine_side.mirror.EngineMirror.step` takes it: what the
        engine knows changed (admissions, finishes, new blocks and tokens), not the
        whole request."""
        from engine_side.mirror import Entry
        from protocol.rebuild import ragged_rows, wire_spec

        slots: list[int] = order.tolist()
        admitted = set(self._admitted)
        added = []
        for slot in self._admitted:
            spec, _, _, _ = wire_spec(self.specs[slot])  # type: ignore[arg-type]
            history = self.tokens[slot, :self.out_len[slot]].copy() \
                if self.scenario.engine_tokens else None
            added.append(Entry(spec, 0, history))
            self._sampled.pop(slot, None)
        grown: tuple[list[int], list[int], list[int]] = ([], [], [])
        tokens: tuple[list[int], list[int], list[int]] = ([], [], [])
        for p, slot in enumerate(slots):
            for rows, values in ((grown, self._grown.get(slot)),
                                 (tokens, None if slot in admitted else self._sampled.get(slot))):
                if values:
                    rows[0].append(p)
                    rows[1].append(len(values))
                    rows[2].extend(values)
        self._grown, self._sampled, self._admitted = {}, {}, []
        return {"batch": req.req_ids, "nsched": req.num_scheduled_tokens.tolist(),
                "finished": req.finished_req_ids, "added": added,
                "computed": req.num_computed_tokens.tolist(),
                "appends": [grown if grown[0] else None],
                "tokens": tokens if tokens[0] else None,
                "spec_tokens": ragged_rows(req.spec_token_ids, 1)}

    def _advance(self, order: IntArray, nsched: IntArray) -> None:
        """The model ran: computed tokens advance, decoding requests sample tokens."""
        k = self.scenario.spec_tokens
        sampling = self.computed[order] + nsched >= self.prefill_target[order]
        decoding = self.computed[order] >= self.prefill_target[order]
        rejected = np.where(decoding, self.rng.integers(0, k + 1, order.size), 0)
        self.computed[order] += nsched - rejected
        new = np.where(sampling, 1 + np.where(decoding, k - rejected, 0), 0)
        if self.scenario.engine_tokens and new.any():
            rows = np.repeat(order, new)
            cols = np.repeat(self.out_len[order] - np.cumsum(new) + new, new) + np.arange(rows.size)
            sampled = self.rng.integers(0, self.vocab, rows.size)
            self.tokens[rows, cols] = sampled
            for slot, token in zip(rows.tolist(), sampled.tolist(), strict=True):
                self._sampled.setdefault(slot, []).append(token)
        self.out_len[order] += new

    def _finish(self, order: IntArray) -> None:
        decoding = self.computed[order] >= self.prefill_target[order]
        done = decoding & (self.rng.random(order.size) < self.scenario.finish_rate)
        done |= self.out_len[order] >= self.max_out - 2 * (1 + self.scenario.spec_tokens)
        for slot in order[done].tolist():
            self.finished.append(self.ids[slot])
            self.free_blocks.extend(self.blocks[slot, : self.nblocks[slot]].tolist())
            self.live[slot] = False
            self.specs[slot] = None
            self.order.remove(slot)


def _frozen(row: IntArray) -> IntArray:
    row.flags.writeable = False
    return row


def _sampling(rng: np.random.Generator) -> SamplingSpec:
    """Chat-like sampling parameters with a little variety."""
    return SamplingSpec(temperature=float(rng.choice([0.6, 0.7, 1.0])), top_p=0.95,
                        max_tokens=int(rng.choice([512, 1024, 4096])), seed=None,
                        stop_token_ids=[128001, 128009])
