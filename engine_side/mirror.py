"""EngineMirror: what the workers know, and the minimal delta to the next step.

The mirror holds a :class:`ReplicaState` identical to every synced worker's.
``diff(request)`` compares the engine's full request with it, builds the
smallest :class:`Delta` that turns one into the other, applies that delta to its
own state through the same code the workers run, and stamps the resulting
digest.  Pure: no sockets, no threads, no clock.

Identity contract: arrays and specs handed to ``diff`` MUST NOT be mutated
afterwards.  A spec or block table that is the very object seen in the previous
step is taken as unchanged without comparing its contents (an engine keeps its
tables while they do not change, as vLLM keeps its block lists); anything else
is compared in full.

Handles: a request gets the lowest free handle when it is first scheduled; the
string id crosses the wire once.  Finishes apply before adds; this mirror hands a
freed handle to a *new* id from the next step on, while an id finished and
re-added in one step keeps its handle and gets a fresh entry (the protocol allows
same-step reuse either way).
"""

from __future__ import annotations

import heapq
from operator import is_not

import numpy as np

from engine_side.diffing import BlockHint, DiffContext, _same_specs
from protocol.errors import LocalProtocolError
from protocol.messages import TOKEN_MODE_WORKER, Delta, DeltaBody, Snapshot
from protocol.plan import STEADY_BODY
from protocol.request import (
    ExecuteModelRequest,
    IntArray,
    Ragged,
    RequestSpec,
    requests_equal,
)
from protocol.snapshot import build_snapshot
from protocol.state import ReplicaState

PREFIX_MIN_TOKENS = 16  # shortest shared prompt prefix worth a reference


_INT64 = np.dtype(np.int64)
_NONE = np.zeros(0, dtype=np.int64)


def _is_int64(values: IntArray, expected: bytes) -> bool:
    """``values`` is a 1-D int64 array holding exactly ``expected`` (False: no verdict)."""
    return (type(values) is np.ndarray and values.dtype is _INT64 and values.ndim == 1
            and values.tobytes() == expected)


class HandleAllocator:
    """Lowest-free integer handles."""

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def allocate(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        self._next += 1
        return self._next - 1

    def release(self, handle: int) -> None:
        heapq.heappush(self._free, handle)


class EngineMirror:
    """The engine's model of the workers' state; produces one Delta per step.

    Args:
        epoch: this engine incarnation (u32); a restarted engine MUST use a new one.
        token_mode: TOKEN_MODE_WORKER (workers own sampled tokens) or TOKEN_MODE_ENGINE.
        kv_groups: number of KV-cache groups (block tables per request).
        verify: rebuild after every diff and compare with the input (tests; O(batch)).
    """

    def __init__(self, epoch: int = 1, token_mode: int = TOKEN_MODE_WORKER, kv_groups: int = 1,
                 verify: bool = False) -> None:
        if not 0 <= epoch < 1 << 32:
            raise LocalProtocolError("epoch must be a u32", epoch=epoch)
        self.epoch = epoch
        self.seq = 0
        self.state = ReplicaState(token_mode, kv_groups)
        self.handles: dict[str, int] = {}
        self.allocator = HandleAllocator()
        self.prefix_index: dict[bytes, int] = {}
        self._prefix_key: dict[int, bytes] = {}
        self.verify = verify
        self._last_ids: list[str] = []
        self._last_handles: IntArray = np.zeros(0, dtype=np.int64)
        self._last_specs: list[RequestSpec] = []
        #: the block tables of the last diffed request: the same object again is unchanged
        self._last_tables: tuple[Ragged, ...] = ()
        #: handle -> the engine's own spec object (identity makes unchanged specs free)
        self.engine_specs: dict[int, RequestSpec] = {}
        self._steady_ok = token_mode == TOKEN_MODE_WORKER  # engine tokens: never empty
        self._nsched: tuple[IntArray, bytes] = (self.state.nsched, b"")  # and its bytes

    def diff(self, request: ExecuteModelRequest, hint: BlockHint | None = None) -> Delta:
        """The delta from the workers' state to ``request``; advances the mirror.
        ``hint``: the caller's word on which block-table rows changed (see BlockHint).

        Raises LocalProtocolError for an inconsistent request (the mirror is then
        unchanged).
        """
        if self._steady_ok and self._is_steady(request):
            return self._advance(request)
        return self._diff(request, hint)

    def apply_body(self, body: DeltaBody) -> Delta:
        """The Delta of a body the caller built against the current schedule itself (an
        adapter's fast path: no adds, finishes or schedule edits); advances the mirror.

        Raises InvalidDelta (mirror unchanged) when the body does not apply.
        """
        if body is STEADY_BODY:
            self.state.advance()
        else:
            self.state.apply(body)
            if body.block_append or body.block_replace:
                self._last_tables = ()  # the last request's tables are stale now
        self.seq += 1
        return Delta(self.epoch, self.seq, self.state.digest, body)

    def lane_delta(self, body: DeltaBody, digest: int) -> Delta:
        """The Delta of a body a :class:`protocol.lane.SteadyLane` over :attr:`state`
        took (its digest); the mirror advances without touching the state."""
        return Delta(self.epoch, self.lane_seq(bool(body.block_append)), digest, body)

    def lane_seq(self, appended: bool) -> int:
        """:meth:`lane_delta`'s seq, for a caller that writes the Delta's frame itself
        (``appended``: the body appends blocks)."""
        if appended:
            self._last_tables = ()  # the last request's tables are stale now
        self.seq += 1
        return self.seq

    def _diff(self, request: ExecuteModelRequest, hint: BlockHint | None = None) -> Delta:
        ctx = DiffContext(self, request, hint)
        try:
            body = ctx.build()
        except LocalProtocolError:
            for req_id, h in ctx.new_ids:  # hand back handles allocated for this request
                if self.handles.get(req_id) != h:
                    self.allocator.release(h)
            raise
        delta = self.apply_turnover(
            body, ctx.freed_ids,
            [(rid, h, request.specs[ctx.added_at[h]]) for rid, h in ctx.new_ids],
            request.req_ids, request.specs)
        self._last_tables = request.block_tables
        if self.verify and not requests_equal(self.state.rebuild(), request):
            raise LocalProtocolError("mirror rebuild differs from the request", seq=self.seq)
        return delta

    def _is_steady(self, r: ExecuteModelRequest) -> bool:
        """The common decode step, checked touching as little as possible: the same
        batch (list identity compares), the very block tables of the last step, no
        step-only field, the same scheduled counts.  The computed counts are compared
        by :meth:`_advance`.  False is no verdict: :class:`DiffContext` then decides."""
        if (r.finished_req_ids or r.preempted_req_ids or r.resumed_req_ids
                or r.free_encoder_mm_hashes or r.blocks_to_zero is not None or r.extension
                or r.has_structured_output_requests or r.pending_structured_output_tokens
                or r.num_spec_tokens_to_schedule or r.output_token_ids is not None):
            return False
        state, tables, last = self.state, r.block_tables, self._last_tables
        if self._last_handles is not state.schedule:
            return False
        if len(tables) == 1 == len(last):  # one KV group: a single identity test
            if tables[0] is not last[0]:
                return False
        elif len(tables) != len(last) or any(map(is_not, tables, last)):
            return False
        n = len(r.req_ids)  # len(): the cheapest probe of a (1-D) array's size
        spec, enc = r.spec_token_ids, r.encoder_inputs
        if (len(spec.values) or len(enc.values) or len(spec.lengths) != n
                or len(enc.lengths) != n or r.req_ids != self._last_ids
                or not _same_specs(r.specs, self._last_specs)):
            return False
        nsched = self._nsched
        if nsched[0] is not state.nsched:
            nsched = self._nsched = (state.nsched, state.nsched.tobytes())
        return _is_int64(r.num_scheduled_tokens, nsched[1])

    def _advance(self, request: ExecuteModelRequest) -> Delta:
        """The steady step: the empty delta, applied through ``state.advance``."""
        state = self.state
        if not _is_int64(request.num_computed_tokens, state.lookahead().prediction()):
            return self._diff(request)
        state.advance()
        self.seq += 1
        if self.verify and not requests_equal(state.rebuild(), request):
            raise LocalProtocolError("mirror rebuild differs from the request", seq=self.seq)
        return Delta(self.epoch, self.seq, state.digest, STEADY_BODY)

    def apply_turnover(self, body: DeltaBody, freed: list[tuple[str, int]],
                       added: list[tuple[str, int, RequestSpec]], req_ids: list[str],
                       specs: list[RequestSpec]) -> Delta:
        """The Delta of a body built against the mirror: by :meth:`diff`, or by an
        adapter's fast path for a step where requests leave the batch and new ones join
        (the same body :meth:`diff` builds).  ``freed``: the finished (id, handle) pairs
        it names; ``added``: the (id, handle, spec) of its adds (handles from
        :attr:`allocator`); ``req_ids`` and ``specs``: the step's batch.  Advances the
        mirror as :meth:`diff` does.

        Raises InvalidDelta (mirror unchanged) when the body does not apply."""
        plan = self.state.apply(body)  # None: a steady step (appends at most)
        self._after_apply(_NONE if plan is None else plan.finished, freed, added, req_ids, specs)
        self._last_tables = ()  # the step's whole tables were never built
        self.seq += 1
        return Delta(epoch=self.epoch, seq=self.seq, digest=self.state.digest, body=body)

    def finish_taken(self, freed: list[tuple[str, int]]) -> int:
        """The seq of a finish step (:mod:`protocol.lane_drop`) whose finish and lane step
        the caller committed to :attr:`state`: ``freed``, the finished (id, handle)
        pairs.  Advances the mirror as :meth:`apply_turnover` does."""
        self._freed([h for _, h in freed], freed, [])
        # (no steady diff follows a step whose whole tables were never built: the batch
        # memory _is_steady reads is left as it is)
        self._last_tables = ()
        self.seq += 1
        return self.seq

    def _after_apply(self, finished: IntArray, freed: list[tuple[str, int]],
                     added: list[tuple[str, int, RequestSpec]], req_ids: list[str],
                     specs: list[RequestSpec]) -> None:
        self._freed(finished.tolist(), freed, added)
        # the state's own schedule array: identity lets the next diff take cached paths
        self._last_ids, self._last_handles = list(req_ids), self.state.schedule
        self._last_specs = list(specs)

    def _freed(self, finished: list[int], freed: list[tuple[str, int]],
               added: list[tuple[str, int, RequestSpec]]) -> None:
        """The finished handles released (but those re-added) and the adds indexed."""
        for h in finished:
            self._drop_prefix(h)
        reused = {h for _, h, _ in added}
        for req_id, h in freed:
            if h not in reused:
                del self.handles[req_id]
                self.engine_specs.pop(h, None)
                self.allocator.release(h)
        for req_id, h, spec in added:
            self._drop_prefix(h)
            self.handles[req_id] = h
            self.engine_specs[h] = spec
            self._index_prefix(h)

    def _index_prefix(self, h: int) -> None:
        prompt = self.state.handle_of(h).prompt_token_ids
        if prompt is not None and prompt.size >= PREFIX_MIN_TOKENS:
            key = prompt[:PREFIX_MIN_TOKENS].tobytes()
            if key not in self.prefix_index:
                self.prefix_index[key] = h
                self._prefix_key[h] = key

    def _drop_prefix(self, h: int) -> None:
        key = self._prefix_key.pop(h, None)
        if key is not None:
            del self.prefix_index[key]

    def snapshot(self) -> Snapshot:
        """The whole state at the current seq (for a joining or resyncing worker)."""
        return build_snapshot(self.state, self.epoch, self.seq)

    def heartbeat_fields(self) -> tuple[int, int, int]:
        """(epoch, seq, digest) of the newest state, for a Heartbeat."""
        return self.epoch, self.seq, self.state.digest

