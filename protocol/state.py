"""The replicated state and its one transition: applying a Delta body.

Theory of operation
-------------------
Rule 1: everything that changes the replicated state lives here.  The engine and
every receiver -- the reference workers and the vLLM ranks alike -- hold a
``ReplicaState`` and apply the same bodies with :meth:`ReplicaState.apply`; the
engine stamps the resulting digest on the Delta and a receiver refuses a body whose
digest differs.

State: live requests by handle (the spec as sent, the computed-token count, per KV
group the block table's length and term sum -- the tables themselves only with
``keep_tables`` -- and, in engine-token mode, the token history), the schedule with
its scheduled-token counts, and the 64-bit digest of all of it (SPEC.md §5), plus two
cached sums: the schedule term and the steady advance (Σ count · key(handle)).

Applying is two-phase: :meth:`_prepare` decodes and checks everything and computes
the resulting digest without mutating; :meth:`_commit` cannot fail, so a bad body
leaves the state exactly as it was.  Cost is O(rows the body names), plus O(schedule)
vector work when the schedule's membership or order changes; a body naming nothing
(the steady decode step) costs one vector add.  Order: SPEC.md §8.3.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from protocol import digest as dg
from protocol import kernels
from protocol.body_rows import all_distinct, read_exceptions, read_rowset, with_exceptions
from protocol.columns import I64, HandleColumns, RowTable
from protocol.errors import InvalidDelta, LocalProtocolError
from protocol.membership import Applied, Membership, RowSet, plan_membership
from protocol.messages import (
    EMPTY_BODY,
    MAX_BLOCK_ID,
    MAX_COUNT,
    NO_RARE,
    TOKEN_MODE_ENGINE,
    TOKEN_MODE_WORKER,
    DeltaBody,
    NewRequest,
    Spec,
)
from protocol.packing import (
    unpack_uint_list,
    unpack_uints,
)

MASK = dg.MASK
U64 = dg.U64
Edit = tuple[I64, I64, I64, I64, U64]  # handles, starts, counts, flat values, row term sums
Rows_ = tuple[list[int], list[int], list[int], list[int], list[int]]  # the same, as lists
_Rows = tuple[list[int], list[int]] | None  # count exceptions: positions, values
_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.flags.writeable = False
#: rows up to this many are written one by one; more, by vector scatters
FEW_ROWS = 16
#: what applying a body that names nothing did (shared: read, never written)
STEADY = Applied()
STEADY.body = EMPTY_BODY


@dataclass(slots=True)
class _Plan:
    """Phase one's result: everything :meth:`ReplicaState._commit` writes."""

    digest: int
    applied: Applied
    member: Membership
    nsched: I64
    sched_term: int
    advance: int
    computed_rows: tuple[list[int], list[int]] | None  # (handles, deltas)
    block_edits: list[Rows_]  # per KV group
    tokens: Edit | None  # token appends (starts after the cuts)
    cuts: tuple[I64, I64, U64] | None  # handles, new lengths, term sums dropped


class ReplicaState:
    """Pure replicated state (no I/O, no clock).

    Args:
        token_mode: TOKEN_MODE_WORKER or TOKEN_MODE_ENGINE (token histories kept).
        kv_groups: block tables per request.
        keep_tables: keep the block tables themselves (snapshots, rebuilt requests);
            without them the digest still covers every block.
    """

    def __init__(self, token_mode: int = TOKEN_MODE_WORKER, kv_groups: int = 1,
                 keep_tables: bool = True) -> None:
        if token_mode not in (TOKEN_MODE_WORKER, TOKEN_MODE_ENGINE):
            raise LocalProtocolError("unknown token mode", token_mode=token_mode)
        if not 1 <= kv_groups <= 64:
            raise LocalProtocolError("kv_groups must be 1..64", kv_groups=kv_groups)
        self.token_mode, self.kv_groups = token_mode, kv_groups
        self.cols = HandleColumns(kv_groups)
        self.requests: list[NewRequest | None] = []  # as added (spec bytes, tensors)
        self.specs: list[Spec | None] = []
        self.tables = [RowTable() for _ in range(kv_groups)] if keep_tables else None
        self.tokens = RowTable(np.int64) if token_mode == TOKEN_MODE_ENGINE else None
        self.schedule: I64 = _EMPTY
        self.nsched: I64 = _EMPTY
        self.sched_term = 0  # Σ (count + 1) * skey(handle, position)
        self.advance = 0  # Σ count * key(handle): the digest change of a steady advance
        self.digest = 0
        self._sched_list: tuple[I64 | None, list[int]] = (None, [])
        self._counts_list: tuple[I64 | None, list[int]] = (None, [])


    # -- applying ----------------------------------------------------------------------
    def apply(self, body: DeltaBody, expected_digest: int | None = None,
              specs: list[Spec] | None = None,
              actual: tuple[list[int], list[int] | None] | None = None,
              before_commit: Callable[[Applied, I64], None] | None = None) -> Applied:
        """Apply ``body``; with ``expected_digest``, refuse a mismatch unchanged.

        The engine's side of a step: ``specs``, the decoded spec of each added request
        (otherwise decoded here); ``actual``, each new schedule position's actual
        scheduled count and computed count (None: as predicted) -- the body's count
        exceptions (which it must not carry) are then derived here, from the protocol's
        predictions, and ``applied.body`` is the completed body to send.  Raises
        InvalidDelta or MalformedMessage (the state unchanged) for a body that does not
        apply.  ``before_commit(applied, schedule)``, with what the body did and the
        schedule it leads to, runs after every check and before the state changes: what
        it raises refuses the body unchanged (a receiver checks its own step data there).
        """
        if (body is EMPTY_BODY or body == EMPTY_BODY) and (
                actual is None or self._as_predicted(*actual)):
            # the steady step (same transition)
            return self._advance(expected_digest, before_commit)
        plan = self._prepare(body, specs, actual)
        if expected_digest is not None and plan.digest != expected_digest:
            raise InvalidDelta("state digest mismatch", expected=expected_digest,
                               got=plan.digest)
        if before_commit is not None:
            before_commit(plan.applied, plan.member.schedule)
        self._commit(plan)
        return plan.applied

    def _as_predicted(self, counts: list[int], computed: list[int] | None) -> bool:
        """Whether a body naming nothing takes the schedule to ``counts`` and
        ``computed`` with no exception (the engine's steady step)."""
        sched, nsched = self.schedule, self.nsched
        if len(counts) != sched.size or counts != self.schedule_counts():
            return False
        return computed is None or (len(computed) == sched.size and not kernels.mismatches(
            computed, self.cols.computed[sched] + nsched))

    def schedule_counts(self) -> list[int]:
        """The scheduled counts as a list (remembered while they are the same array)."""
        known = self._counts_list
        if known[0] is not self.nsched:
            known = self._counts_list = (self.nsched, self.nsched.tolist())
        return known[1]

    def _advance(self, expected_digest: int | None,
                 before_commit: Callable[[Applied, I64], None] | None = None) -> Applied:
        """A body naming nothing: the schedule repeats and every computed count advances
        by its scheduled count (SPEC §8.3 step 6a alone; ``advance`` holds its digest
        change)."""
        digest = (self.digest + self.advance) & MASK
        if expected_digest is not None and digest != expected_digest:
            raise InvalidDelta("state digest mismatch", expected=expected_digest, got=digest)
        if before_commit is not None:
            before_commit(STEADY, self.schedule)
        if self.schedule.size:
            self.cols.computed[self.schedule] += self.nsched
        self.digest = digest
        return STEADY

    def _prepare(self, body: DeltaBody, specs: list[Spec] | None,
                  actual: tuple[list[int], list[int] | None] | None) -> _Plan:
        applied = Applied()
        member = plan_membership(self, body, specs, applied)
        new, prev_n = member.schedule, self.nsched
        made: tuple[_Rows, _Rows] = (None, None)  # the exceptions derived here, decoded
        if actual is not None:
            body, made = with_exceptions(body, member, *actual)
        applied.body = body
        d = (self.digest + member.change) & MASK
        nsched = member.counts
        rows = body.scheduled_tokens
        if rows is not None:  # 7. scheduled-count exceptions
            pos, values = made[0] or read_exceptions(rows, new.size, signed=False)
            if pos:
                nsched = nsched.copy() if nsched is prev_n else nsched
                nsched[pos] = values
                applied.recounted = pos
        if nsched is not prev_n:
            nsched.flags.writeable = False
        sched_term, advance = self._terms(new, nsched, new is self.schedule,
                                          applied.recounted + (member.kept_reset or []))
        d += sched_term - self.sched_term
        computed_rows = None
        if body.computed_tokens is not None:  # 6b. computed-count exceptions
            pos, deltas = made[1] or read_exceptions(body.computed_tokens, new.size,
                                                      signed=True)
            if new is self.schedule and not member.adds:  # positions of the last schedule
                sched = self.schedule_list(new)
                hs = [sched[p] for p in pos]
                base = (self.cols.computed[hs] + prev_n[pos]).tolist() if pos else []
            else:
                hs = new[pos].tolist() if pos else []
                base = member.computed_after(hs)
            if any(not 0 <= b + x <= MAX_COUNT for b, x in zip(base, deltas, strict=True)):
                raise InvalidDelta("a computed count would leave 0..MAX_COUNT")
            d += sum(x * dg.handle_key(h) for h, x in zip(hs, deltas, strict=True))
            computed_rows = (hs, deltas)
        edits, change = self._blocks(body, new, member.reset, applied)
        d += change
        tokens, cuts, change = self._tokens(body, new, member)
        if body.spec_tokens is not None or body.rare is not NO_RARE:
            self._step_fields(body, new.size, member, applied)
        return _Plan((d + change) & MASK, applied, member, nsched, sched_term, advance,
                     computed_rows, edits, tokens, cuts)

    def _step_fields(self, body: DeltaBody, n: int, member: Membership,
                     applied: Applied) -> None:
        """8. The fields that only describe this step, checked and decoded: rows keyed
        by schedule position, handles live after the body, packed block ids."""
        rare = body.rare
        if body.spec_tokens is not None:
            applied.spec_rows = read_rowset(body.spec_tokens, n)
        if rare.encoder_inputs is not None:
            applied.encoder_rows = read_rowset(rare.encoder_inputs, n)
        for name in ("preempted", "resumed"):
            packed = getattr(rare, name)
            if packed:
                hs = unpack_uint_list(packed)
                added = {a[0] for a in member.adds}
                specs = self.specs
                if any(h not in added and (h >= len(specs) or specs[h] is None
                                           or h in applied.finished) for h in hs):
                    raise InvalidDelta(f"{name} handles must be live", handles=len(hs))
                setattr(applied, name, hs)
        if rare.blocks_to_zero is not None:
            applied.zero = unpack_uint_list(rare.blocks_to_zero) if rare.blocks_to_zero else []

    def _terms(self, new: I64, nsched: I64, same: bool, changed: list[int]) -> tuple[int, int]:
        """The schedule term and the advance constant of (new, nsched); ``same``: ``new``
        is the current schedule and ``nsched`` differs from its counts at most at the
        positions ``changed``."""
        prev_n = self.nsched
        if same and nsched is prev_n:
            return self.sched_term, self.advance
        if same and len(changed) <= dg.SMALL and (len(changed) * 32 < new.size
                                                    or not kernels.NATIVE):
            # counts changed at a few positions (at most ``changed``): their terms alone
            sched = self.schedule_list(new)
            st = adv = 0
            for p in set(changed):
                m = int(nsched[p]) - int(prev_n[p])
                if m:
                    h = sched[p]
                    st += m * dg.schedule_key(h, p)
                    adv += m * dg.handle_key(h)
            return (self.sched_term + st) & MASK, (self.advance + adv) & MASK
        return dg.schedule_term(new, nsched), dg.keyed_sum(new, nsched)

    def _blocks(self, body: DeltaBody, new: I64, reset: set[int] | frozenset[int],
                applied: Applied,
                ) -> tuple[list[Rows_], int]:
        """5. Per group, the replaced then appended rows as (handles, starts, counts,
        ids, term sums), and the digest change."""
        groups = self.kv_groups
        replace, append = body.rare.block_replace, body.block_append
        if not replace and not append:
            return [], 0
        if (replace and len(replace) != groups) or (append and len(append) != groups):
            raise InvalidDelta("block rows must have one entry per KV group")
        applied.blocks, applied.replaced = [None] * groups, [None] * groups
        cols, edits, d = self.cols, [], 0
        sched = self.schedule_list(new)
        for g in range(groups):
            block_len, block_sum = cols.block_len[g], cols.block_sum[g]
            hs: list[int] = []
            starts: list[int] = []
            counts: list[int] = []
            ids: list[int] = []
            length: dict[int, int] = {}  # replaced rows' lengths, for the appends after them
            for rows, out in ((replace[g] if replace else None, applied.replaced),
                              (append[g] if append else None, applied.blocks)):
                if rows is None:
                    continue
                rs = read_rowset(rows, new.size)
                if not rs.keys:
                    continue
                if rs.values and max(rs.values) > MAX_BLOCK_ID:
                    raise InvalidDelta("block id out of range")
                out[g] = rs
                row_hs = [sched[p] for p in rs.keys]
                if out is applied.replaced:
                    d -= sum(int(block_sum[h]) for h in row_hs if h not in reset)
                    row_starts = [0] * len(row_hs)
                    for h, n in zip(row_hs, rs.counts, strict=True):
                        length[h] = n
                elif reset or length:
                    row_starts = [length.get(h, 0 if h in reset else int(block_len[h]))
                                  for h in row_hs]
                else:
                    row_starts = [int(block_len[h]) for h in row_hs]
                hs += row_hs
                starts += row_starts
                counts += rs.counts
                ids += rs.values
            sums = dg.block_row_terms(hs, g, starts, counts, ids)
            d += sum(sums)
            edits.append((hs, starts, counts, ids, sums))
        return edits, d

    def _tokens(self, body: DeltaBody, new: I64, member: Membership,
                ) -> tuple[Edit | None, tuple[I64, I64, U64] | None, int]:
        """4. Truncations, then token appends (engine-token mode), and the digest change."""
        trunc_rows, rows = body.rare.truncate, body.tokens
        if trunc_rows is None and rows is None:
            return None, None, 0
        if self.tokens is None:
            raise InvalidDelta("tokens in worker-token mode")
        d, cuts = 0, None
        length = member.token_lengths(new)
        if trunc_rows is not None:
            pos, values = read_exceptions(trunc_rows, new.size, signed=False)
            hs = new[pos]
            to = np.asarray(values, dtype=np.int64)
            if (to > length[pos]).any():
                raise InvalidDelta("truncation beyond the history")
            fresh = {h: toks for h, _, _, _, toks in member.adds if toks is not None}
            dropped = np.asarray([dg.total(dg.token_sums(
                np.array([h]), np.array([n]), np.array([int(length[p]) - n]),
                (fresh[h] if h in fresh else self.tokens.row(h))[n:int(length[p])]))
                for h, n, p in zip(hs.tolist(), values, pos, strict=True)], dtype=np.uint64)
            d -= dg.total(dropped)
            length = length.copy()
            length[pos] = to
            cuts = (hs, to, dropped)
        tokens = None
        if rows is not None:
            flat = unpack_uints(rows.values) if rows.values else _EMPTY
            if rows.keys:
                keys = unpack_uints(rows.keys)
                if keys.size and (int(keys.max()) >= new.size or not all_distinct(keys)):
                    raise InvalidDelta("token rows must be distinct schedule positions")
            else:  # every position, in order
                keys = None
            n = new.size if keys is None else keys.size
            counts = unpack_uints(rows.counts) if rows.counts else None
            if (n if counts is None else int(counts.sum())) != flat.size or (
                    counts is not None and counts.size != n):
                raise InvalidDelta("token rows do not fit the schedule")
            if counts is None:
                counts = np.ones(n, dtype=np.int64)
            hs, starts = (new, length) if keys is None else (new[keys], length[keys])
            sums = dg.token_sums(hs, starts, counts, flat)
            d += dg.total(sums)
            tokens = (hs, starts, counts, flat, sums)
        return tokens, cuts, d

    # -- phase two -----------------------------------------------------------------------
    def _commit(self, plan: _Plan) -> None:
        cols, prev, member = self.cols, self.schedule, plan.member
        if prev.size:
            cols.computed[prev] += self.nsched
        for h in plan.applied.finished:
            self._forget(h)
        for h, new, spec, term, toks in member.adds:
            self._install(h, new, spec, term, toks)
        if plan.computed_rows is not None:
            for h, x in zip(*plan.computed_rows, strict=True):
                cols.computed[h] += x
        if member.schedule is not prev:
            cols.pos[prev] = -1
            cols.pos[member.schedule] = np.arange(member.schedule.size)
        self.schedule, self.nsched = member.schedule, plan.nsched
        self.sched_term, self.advance = plan.sched_term, plan.advance
        for g, edit in enumerate(plan.block_edits):
            if edit[0]:
                self._commit_blocks(g, *edit)
        if plan.cuts is not None:
            hs, to, dropped = plan.cuts
            cols.token_len[hs] = to
            cols.token_sum[hs] -= dropped
        if plan.tokens is not None:
            hs, starts, counts, values, sums = plan.tokens
            assert self.tokens is not None  # engine-token mode (checked in phase one)
            if hs.size:
                self._write_rows(self.tokens, hs, starts, counts, values,
                                 distinct=True)  # (distinct schedule positions)
                cols.token_len[hs] = starts + counts
                cols.token_sum[hs] += sums  # (uint64 wraps: sums are mod 2**64)
        self.digest = plan.digest

    def _commit_blocks(self, g: int, hs: list[int], starts: list[int], counts: list[int],
                       ids: list[int], sums: list[int]) -> None:
        """One KV group's replaced and appended rows (a handle's later row wins)."""
        cols, table = self.cols, None if self.tables is None else self.tables[g]
        if len(hs) <= FEW_ROWS:
            block_sum, block_len, at = cols.block_sum[g], cols.block_len[g], 0
            for h, start, n, term in zip(hs, starts, counts, sums, strict=True):
                block_sum[h] = term if start == 0 else (int(block_sum[h]) + term) & MASK
                block_len[h] = start + n
                if table is not None:
                    table.write(h, start, ids[at:at + n])
                at += n
            return
        h_, s_, n_ = (np.asarray(v, dtype=np.int64) for v in (hs, starts, counts))
        cols.block_sum[g, h_[s_ == 0]] = 0
        np.add.at(cols.block_sum[g], h_, np.asarray(sums, dtype=np.uint64))
        cols.block_len[g, h_] = 0  # a handle's rows continue each other: the last ends furthest
        np.maximum.at(cols.block_len[g], h_, s_ + n_)
        if table is not None:
            self._write_rows(table, h_, s_, n_, np.asarray(ids, dtype=np.int64))

    @staticmethod
    def _write_rows(table: RowTable, hs: I64, starts: I64, counts: I64, values: I64,
                    distinct: bool = False) -> None:
        """Rows into ``table``; distinct handles in the many-row case (a handle's rows
        that continue each other are written one by one, in order).  ``distinct``: the
        caller knows the handles are."""
        if hs.size > FEW_ROWS and (distinct or all_distinct(hs)):
            table.scatter(hs, starts, counts, values)
            return
        at = 0
        for h, start, n in zip(hs.tolist(), starts.tolist(), counts.tolist(), strict=True):
            table.write(h, start, values[at:at + n])
            at += n

    def _forget(self, h: int) -> None:
        cols = self.cols
        cols.live[h] = False
        cols.spec_term[h] = cols.computed[h] = cols.token_sum[h] = cols.token_len[h] = 0
        cols.block_len[:, h] = 0
        cols.block_sum[:, h] = 0
        self.requests[h] = self.specs[h] = None
        for table in (*(self.tables or ()), *((self.tokens,) if self.tokens else ())):
            table.clear(h)

    def _install(self, h: int, new: NewRequest, spec: Spec, term: int,
                 tokens: I64 | None) -> None:
        cols = self.cols
        cols.ensure(h)
        if cols.live[h]:
            self._forget(h)
        grow = h + 1 - len(self.specs)
        if grow > 0:
            self.specs.extend([None] * grow)
            self.requests.extend([None] * grow)
        cols.live[h] = True
        cols.spec_term[h] = term
        cols.computed[h] = new.computed
        self.specs[h], self.requests[h] = spec, new
        if tokens is not None and tokens.size and self.tokens is not None:
            self.tokens.write(h, 0, tokens)
            cols.token_len[h] = tokens.size
            cols.token_sum[h] = dg.total(dg.token_sums(
                np.array([h]), np.zeros(1, np.int64), np.array([tokens.size]), tokens))

    # -- reading -------------------------------------------------------------------------
    def schedule_list(self, schedule: I64 | None = None) -> list[int]:
        """``schedule`` (default: the current one) as a list of handles, remembered for
        the last array asked for (schedules are replaced, never edited in place)."""
        if schedule is None:
            schedule = self.schedule
        known = self._sched_list
        if known[0] is not schedule:
            known = self._sched_list = (schedule, schedule.tolist())
        return known[1]

    def live_handles(self) -> I64:
        return np.flatnonzero(self.cols.live).astype(np.int64)

    def spec_of(self, h: int) -> Spec:
        spec = self.specs[h] if 0 <= h < len(self.specs) else None
        if spec is None:
            raise LocalProtocolError("handle is not live", handle=h)
        return spec

    def token_history(self, h: int) -> I64:
        """Handle ``h``'s tokens (engine-token mode; a fresh array)."""
        if self.tokens is None:
            return np.zeros(0, dtype=np.int64)
        if h >= self.tokens.lengths.size:
            return np.zeros(0, dtype=np.int64)
        return self.tokens.table[h, :self.cols.token_len[h]].astype(np.int64)

    def recompute_digest(self) -> int:
        """The digest from scratch, O(state): for tests and verification."""
        total, cols = 0, self.cols
        for h in self.live_handles().tolist():
            total += int(cols.spec_term[h]) + int(cols.computed[h]) * dg.handle_key(h)
            if self.tables is not None:
                for g, table in enumerate(self.tables):
                    row = table.row(h).tolist()
                    total += dg.block_row_terms([h], g, [0], [len(row)], row)[0] if row else 0
            else:
                total += int(cols.block_sum[:, h].sum(dtype=np.uint64))
            toks = self.token_history(h)
            if toks.size:
                total += dg.total(dg.token_sums(np.array([h]), np.zeros(1, np.int64),
                                                np.array([toks.size]), toks))
        total += dg.schedule_term(self.schedule, self.nsched)
        return total & MASK


__all__ = ["STEADY", "Applied", "ReplicaState", "RowSet"]
