"""EngineMirror: the workers' state as the engine knows it, and one Delta per step.

The mirror holds a :class:`ReplicaState` identical to every synced worker's.  Each
step the engine tells it what changed -- :meth:`EngineMirror.step`: the batch in
order with its scheduled counts, requests that finished or joined, the actual
computed counts, block and token appends -- and the mirror writes the smallest body
that turns the previous state into that one: the schedule's edits, and only the
counts that depart from the protocol's predictions (SPEC §8.3).  It applies the body
to its own state through the code every worker runs and stamps the digest.
:meth:`EngineMirror.diff` derives those changes from a whole request instead (a
convenience, and the tests' oracle).  Pure: no sockets, threads or clock.

Handles: a request gets the lowest free handle when it joins; the id crosses the wire
once.  A handle freed by a finish is reused from the next step on; an id finished and
re-added in one step, or re-added while live, keeps its handle (a fresh entry).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence
from itertools import compress
from typing import Any, NamedTuple

import msgspec

from protocol.errors import LocalProtocolError, ProtocolError
from protocol.messages import (
    EMPTY_BODY,
    NO_RARE,
    TOKEN_MODE_WORKER,
    Delta,
    DeltaBody,
    NewRequest,
    RareBody,
    Rows,
    Snapshot,
    Spec,
    encode_spec,
)
from protocol.packing import pack_row_counts, pack_uints
from protocol.snapshot import build_snapshot
from protocol.state import Applied, ReplicaState

#: rows of one KV group: (positions in the new batch, values per row, flat values)
BlockRows = tuple[list[int], list[int], list[int]]


class Entry(NamedTuple):
    """A request joining the state: its spec and what travels beside it."""

    spec: Spec
    computed: int = 0
    tokens: Any = None  # engine-token mode: its whole token history
    mm_data: tuple[Any, ...] = ()
    mm_embed: tuple[Any, ...] = ()
    embeds: Any = None


def rows(keys: list[int], counts: list[int], values: list[int], n: int = -1) -> Rows:
    """The Rows of (positions, counts, flat values); counts omitted when all are one,
    keys omitted when they are every position ``0..n-1`` in order."""
    every = len(keys) == n and keys[-1] == n - 1 and keys == list(range(n)) if n > 0 else False
    return Rows(keys=b"" if every else pack_uints(keys), counts=pack_row_counts(counts),
                values=pack_uints(values))


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
    """The engine's model of the workers' state; one Delta per step.

    Args:
        epoch: this engine incarnation (u32); a restarted engine MUST use a new one.
        token_mode: TOKEN_MODE_WORKER (workers own sampled tokens) or TOKEN_MODE_ENGINE.
        kv_groups: block tables per request.
        keep_tables: keep whole block tables (snapshots need them).
    """

    def __init__(self, epoch: int = 1, token_mode: int = TOKEN_MODE_WORKER, kv_groups: int = 1,
                 keep_tables: bool = True) -> None:
        if not 0 <= epoch < 1 << 32:
            raise LocalProtocolError("epoch must be a u32", epoch=epoch)
        self.epoch, self.seq = epoch, 0
        self.state = ReplicaState(token_mode, kv_groups, keep_tables)
        self.ids: dict[str, int] = {}  # live request id -> handle
        self.allocator = HandleAllocator()
        self.batch: list[str] = []  # the last step's batch (schedule order)
        self._nsched: list[int] = []  # and its counts

    # -- the step -----------------------------------------------------------------------
    def step(self, batch: list[str], nsched: list[int], *, finished: Collection[str] = (),
             added: Sequence[Entry] = (), computed: list[int] | None = None,
             appends: Sequence[BlockRows | None] = (),
             replaces: Sequence[BlockRows | None] = (),
             tokens: BlockRows | None = None, truncate: tuple[list[int], list[int]] | None = None,
             spec_tokens: Rows | None = None, encoder_inputs: Rows | None = None,
             preempted: Collection[str] = (), resumed: Collection[str] = (),
             free_encoder_mm_hashes: tuple[str, ...] = (), blocks_to_zero: Any = None,
             structured: bool = False, pending: bool = False, num_spec: int = 0,
             extension: bytes = b"") -> tuple[Delta, Applied]:
        """The Delta of one step, applied to the mirror.

        ``batch``: the scheduled request ids in order, ``nsched`` their scheduled counts;
        ``finished``: ids that ended since the last step (unknown ones are passed on by
        name); ``added``: requests joining (or re-sent: a live id is replaced);
        ``computed``: each batch row's computed count (None: as the protocol predicts);
        block and token rows name positions in ``batch``.

        Raises LocalProtocolError for an inconsistent step (the mirror unchanged).
        """
        ids = self.ids
        fin: list[int] = []
        fin_ids: set[str] = set()
        unknown: list[str] = []
        for r in finished:
            h = ids.get(r)
            if h is None:
                unknown.append(r)
            else:
                fin.append(h)
                fin_ids.add(r)
        if len(fin) > 1 or len(unknown) > 1:  # (bytes independent of set order)
            fin.sort()
            unknown.sort()
        joined: dict[str, int] = {}
        fresh: list[int] = []
        for entry in added:
            if not entry.spec.prompt and not entry.spec.prompt_none:
                raise LocalProtocolError("a spec carries packed prompt ids or prompt_none",
                                         req_id=entry.spec.req_id)
            h = ids.get(entry.spec.req_id)
            if h is None:
                h = self.allocator.allocate()
                fresh.append(h)
            joined[entry.spec.req_id] = h
        try:
            rare = NO_RARE
            if unknown or encoder_inputs is not None or preempted or resumed \
                    or free_encoder_mm_hashes or blocks_to_zero is not None or num_spec \
                    or truncate is not None or (replaces and any(r is not None for r in replaces)):
                rare = RareBody(
                    finished_unknown=tuple(unknown), encoder_inputs=encoder_inputs,
                    preempted=self._pack_ids(preempted, joined),
                    resumed=self._pack_ids(resumed, joined),
                    free_encoder_mm_hashes=tuple(free_encoder_mm_hashes),
                    blocks_to_zero=None if blocks_to_zero is None else pack_uints(blocks_to_zero),
                    num_spec_tokens_to_schedule=num_spec,
                    block_replace=_groups(replaces, self.state.kv_groups),
                    truncate=None if truncate is None else Rows(
                        keys=pack_uints(truncate[0]), values=pack_uints(truncate[1])))
            delta, applied = self._step(batch, nsched, fin, fin_ids, added, joined, computed,
                                        appends, tokens, rare, spec_tokens, structured,
                                        pending, extension)
        except (ProtocolError, KeyError, IndexError, ValueError, TypeError) as exc:
            for h in fresh:
                self.allocator.release(h)
            if isinstance(exc, LocalProtocolError):
                raise
            raise LocalProtocolError("the step does not apply to the mirror",
                                     cause=f"{type(exc).__name__}: {exc}"[:200]) from exc
        self._after(batch, nsched, fin_ids, joined)
        return delta, applied

    def _pack_ids(self, names: Collection[str], joined: dict[str, int]) -> bytes:
        if not names:
            return b""
        return pack_uints(sorted(joined[r] if r in joined else self.ids[r] for r in names))

    def _step(self, batch: list[str], nsched: list[int], fin: list[int], fin_ids: set[str],
              added: Sequence[Entry], joined: dict[str, int], computed: list[int] | None,
              appends: Sequence[BlockRows | None], tokens: BlockRows | None,
              rare: RareBody, spec_tokens: Rows | None, structured: bool, pending: bool,
              extension: bytes) -> tuple[Delta, Applied]:
        state = self.state
        specs = [e.spec for e in added] if added else []
        news = tuple(NewRequest(handle=h, spec=encode_spec(e.spec), computed=e.computed,
                                output=b"" if e.tokens is None else pack_uints(e.tokens),
                                mm_data=e.mm_data, mm_embed=e.mm_embed, embeds=e.embeds)
                     for h, e in zip(joined.values(), added, strict=True)) if added else ()
        drop = append = b""
        if fin or news or batch != self.batch:
            drop, append, full = self._edits(batch, fin_ids, joined)
            if full:
                rare = msgspec.structs.replace(rare, schedule_full=full)
        blocks = _groups(appends, state.kv_groups) if appends else ()
        if not (fin or news or drop or append or blocks or tokens or spec_tokens or structured
                or pending or extension) and rare is NO_RARE:
            body = EMPTY_BODY  # (count exceptions, if any, are added by apply)
        else:
            body = DeltaBody(
                finished=pack_uints(fin) if fin else b"", added=news, schedule_drop=drop,
                schedule_append=append, block_append=blocks,
                tokens=None if tokens is None else rows(*tokens, n=len(batch)),
                spec_tokens=spec_tokens, has_structured_output=structured,
                pending_structured_output=pending, rare=rare, extension=extension)
        same = nsched == self._nsched and computed is None and body is EMPTY_BODY
        applied = state.apply(body, specs=specs, actual=None if same else (nsched, computed))
        self.seq += 1
        return Delta(self.epoch, self.seq, state.digest, applied.body), applied  # type: ignore[arg-type]

    def _edits(self, batch: list[str], fin_ids: set[str],
               joined: dict[str, int]) -> tuple[bytes, bytes, bytes]:
        """(schedule_drop, schedule_append, schedule_full) taking the last schedule to
        ``batch``: drops and appends when the kept requests keep their order (a request
        finished or re-added in place keeps its position)."""
        old, ids = self.batch, self.ids
        gone = fin_ids.difference(joined) if fin_ids else fin_ids
        cut: list[int] | None = None
        if len(gone) <= 8:  # the common step: a few finish, the rest keep their order
            cut = sorted(old.index(r) for r in gone if r in old)
            kept = old.copy() if cut else old
            for p in reversed(cut):
                del kept[p]
            if batch[:len(kept)] != kept:
                cut = None  # (others left or moved: the general case below)
        if cut is None:
            staying = set(batch).difference(gone)
            keep = [r in staying for r in old]
            kept = list(compress(old, keep))
            if batch[:len(kept)] == kept:
                cut = [p for p, k in enumerate(keep) if not k]
        if cut is not None:
            tail = batch[len(kept):]
            try:
                handles = [joined[r] if r in joined else ids[r] for r in tail]
            except KeyError as exc:
                raise LocalProtocolError("the batch names a request that is not live",
                                         req_id=str(exc)) from None
            return (pack_uints(cut) if cut else b"", pack_uints(handles) if handles else b"",
                    b"")
        try:
            return b"", b"", pack_uints([joined[r] if r in joined else ids[r] for r in batch])
        except KeyError as exc:
            raise LocalProtocolError("the batch names a request that is not live",
                                     req_id=str(exc)) from None

    def _after(self, batch: list[str], nsched: list[int], fin_ids: set[str],
               joined: dict[str, int]) -> None:
        """The mirror's memory after an applied step: ids and handles, the batch."""
        readded = set(joined.values())
        for rid in fin_ids:
            h = self.ids.pop(rid)
            if h not in readded:
                self.allocator.release(h)
        self.ids.update(joined)
        self.batch, self._nsched = list(batch), list(nsched)

    # -- reading -----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        """The whole state at the current seq (for a joining or resyncing worker)."""
        return build_snapshot(self.state, self.epoch, self.seq)

    def heartbeat_fields(self) -> tuple[int, int, int]:
        """(epoch, seq, digest) of the newest state, for a Heartbeat."""
        return self.epoch, self.seq, self.state.digest


def _groups(per_group: Sequence[BlockRows | None], groups: int) -> tuple[Rows, ...]:
    """One Rows per KV group (empty rows where a group has none), or () for none at all."""
    if not per_group or all(g is None or not g[0] for g in per_group):
        return ()
    if len(per_group) != groups:
        raise LocalProtocolError("block rows must have one entry per KV group",
                                 got=len(per_group), groups=groups)
    return tuple(rows(*g) if g is not None and g[0] else Rows(keys=pack_uints([]))
                 for g in per_group)
