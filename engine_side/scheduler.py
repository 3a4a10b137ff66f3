"""A small continuous-batching scheduler driven by sampled tokens (engine-token mode).

Pure: no I/O, no clock.  Each step :meth:`Scheduler.schedule` returns a full
:class:`ExecuteModelRequest`; after the step runs, :meth:`Scheduler.update`
takes the tokens the workers sampled.  Policy (vLLM v1 in miniature):

* Running requests are scheduled every step, in order: one token each first
  (decodes), then the remaining token budget tops up prefill chunks (chunked
  prefill).  Waiting requests are admitted FCFS while budget, ``max_running``
  and KV blocks allow.
* KV blocks come from a fixed pool.  When the running requests' next tokens
  do not fit, the newest running request is preempted: its blocks are freed,
  its computed count drops to 0 and it waits at the head of the queue; when it
  is scheduled again it recomputes prompt + outputs (listed in
  ``resumed_req_ids``).  It stays live on the workers meanwhile.
* A request samples a token when a step reaches the end of its known sequence
  (prompt + outputs); it finishes at ``max_tokens`` outputs and is listed in
  the next step's ``finished_req_ids``.

Output histories are preallocated arrays handed out as read-only prefix views,
so a step costs O(batch), not O(history).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from protocol.params import SamplingSpec
from protocol.request import ExecuteModelRequest, IntArray, Ragged, RequestSpec


@dataclass
class Sequence:
    """One request's scheduling state."""

    spec: RequestSpec
    prompt_len: int
    max_tokens: int
    output: IntArray  # preallocated; the first ``num_output`` entries are valid
    num_output: int = 0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    preempted: bool = False

    @property
    def req_id(self) -> str:
        return self.spec.req_id

    @property
    def known(self) -> int:
        """Tokens whose ids are known: prompt plus sampled outputs."""
        return self.prompt_len + self.num_output

    def output_view(self) -> IntArray:
        view = self.output[: self.num_output]
        view.flags.writeable = False
        return view


class Scheduler:
    """Continuous batching over a KV block pool.

    Args:
        num_blocks: KV blocks in the pool (the workers' runners need at least this many).
        block_size: token slots per block.
        token_budget: tokens scheduled per step at most (must be >= max_running).
        max_running: requests scheduled together at most.
    """

    def __init__(self, num_blocks: int = 256, block_size: int = 16, token_budget: int = 128,
                 max_running: int = 32) -> None:
        if token_budget < max_running:
            raise ValueError("token_budget must be >= max_running (every runner decodes)")
        self.block_size, self.token_budget, self.max_running = block_size, token_budget, max_running
        self.free: deque[int] = deque(range(num_blocks))
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished: dict[str, IntArray] = {}
        self.num_preemptions = 0
        self._by_id: dict[str, Sequence] = {}
        self._plan: dict[str, int] = {}
        self._finished_pending: set[str] = set()

    def add(self, req_id: str, prompt: IntArray, max_tokens: int,
            sampling: SamplingSpec | None = None) -> None:
        prompt = np.array(prompt, dtype=np.int64)
        prompt.flags.writeable = False
        need = -(-(prompt.size + max_tokens) // self.block_size)
        if need > len(self.free) + sum(len(s.blocks) for s in self._by_id.values()):
            raise ValueError(f"{req_id} can never fit in the KV pool")
        seq = Sequence(RequestSpec(req_id, prompt, sampling), int(prompt.size), max_tokens,
                       np.zeros(max_tokens, dtype=np.int64))
        self._by_id[req_id] = seq
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step -----------------------------------------------------------------
    def schedule(self) -> ExecuteModelRequest:
        """The next step's request (every running request scheduled, in order)."""
        preempted = self._fit_running()
        plan: dict[str, int] = {}
        for s in self.running:  # one token each always fits after _fit_running
            self._allocate(s, s.num_computed + 1)
            plan[s.req_id] = 1
        budget = self.token_budget - len(plan)
        for s in self.running:  # top up prefill chunks
            extra = self._fit(s, min(s.known - s.num_computed - 1, budget), start=1)
            plan[s.req_id] += extra
            budget -= extra
        resumed = self._admit(plan, budget, preempted)
        self._plan = plan
        return self._request(plan, preempted, resumed)

    def _fit_running(self) -> set[str]:
        """Preempt from the tail until every running request's next token fits."""
        preempted: set[str] = set()
        while self.running:
            need = sum(self._blocks_needed(s, s.num_computed + 1) for s in self.running)
            if need <= len(self.free):
                break
            victim = self.running.pop()
            self.free.extend(victim.blocks)
            victim.blocks, victim.num_computed, victim.preempted = [], 0, True
            self.waiting.appendleft(victim)
            preempted.add(victim.req_id)
            self.num_preemptions += 1
        return preempted

    def _fit(self, s: Sequence, want: int, start: int) -> int:
        """Allocate room for up to ``want`` tokens after ``start`` new ones; returns how many."""
        base = s.num_computed + start
        room = (len(s.blocks) + len(self.free)) * self.block_size - base
        n = max(0, min(want, room))
        self._allocate(s, base + n)
        return n

    def _admit(self, plan: dict[str, int], budget: int, preempted: set[str]) -> set[str]:
        resumed: set[str] = set()
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            s = self.waiting[0]
            if s.req_id in preempted:
                break  # not preempted and resumed in one step
            n = self._fit(s, min(s.known - s.num_computed, budget), start=0)
            if n <= 0:
                break
            self.waiting.popleft()
            self.running.append(s)
            plan[s.req_id] = n
            budget -= n
            if s.preempted:
                resumed.add(s.req_id)
                s.preempted = False
        return resumed

    def _blocks_needed(self, s: Sequence, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - len(s.blocks))

    def _allocate(self, s: Sequence, tokens: int) -> None:
        for _ in range(self._blocks_needed(s, tokens)):
            s.blocks.append(self.free.popleft())

    def _request(self, plan: dict[str, int], preempted: set[str],
                 resumed: set[str]) -> ExecuteModelRequest:
        seqs = self.running
        finished = frozenset(self._finished_pending)
        self._finished_pending = set()
        return ExecuteModelRequest(
            req_ids=[s.req_id for s in seqs], specs=[s.spec for s in seqs],
            num_scheduled_tokens=np.array([plan[s.req_id] for s in seqs], dtype=np.int64),
            num_computed_tokens=np.array([s.num_computed for s in seqs], dtype=np.int64),
            block_tables=(Ragged.from_lists([s.blocks for s in seqs]),),
            spec_token_ids=Ragged.empty(len(seqs)), encoder_inputs=Ragged.empty(len(seqs)),
            output_token_ids=[s.output_view() for s in seqs],
            finished_req_ids=finished, preempted_req_ids=frozenset(preempted),
            resumed_req_ids=frozenset(resumed),
        )

    # -- results ------------------------------------------------------------------------
    def expected_samplers(self) -> list[str]:
        """Ids that sample a token in the step just scheduled (batch order)."""
        return [s.req_id for s in self.running
                if s.num_computed + self._plan[s.req_id] == s.known]

    def update(self, sampled_ids: list[str], tokens: list[int]) -> list[str]:
        """Advance by the step just scheduled; returns the ids that finished.

        Raises ValueError if the sampled ids are not exactly the requests that
        reached the end of their known sequence.
        """
        if sampled_ids != self.expected_samplers():
            raise ValueError(f"sampled ids {sampled_ids[:4]}... do not match the schedule")
        for s in self.running:
            s.num_computed += self._plan[s.req_id]
        done: list[str] = []
        for req_id, token in zip(sampled_ids, tokens, strict=True):
            s = self._by_id[req_id]
            s.output[s.num_output] = token
            s.num_output += 1
            if s.num_output >= s.max_tokens:
                done.append(req_id)
        for req_id in done:
            self._finish(self._by_id.pop(req_id))
        return done

    def _finish(self, s: Sequence) -> None:
        self.running.remove(s)
        self.free.extend(s.blocks)
        s.blocks = []
        self._finished_pending.add(s.req_id)
        self.finished[s.req_id] = s.output[: s.num_output].copy()
