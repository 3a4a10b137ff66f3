"""The finish step: requests finish and leave the schedule, the rest take a lane step.

Theory of operation
-------------------
When scheduled requests finish, vLLM's next step schedules the others in their
order.  Its body (``finished`` handles, the ``schedule_drop`` of exactly their
positions, and lane-shaped rows for the stayers: count exceptions, appends, drafts,
step fields) is, for the state, two edits in turn: the finished requests leave
(their digest terms go, the schedule and its counts lose their positions, the
stayers' computed counts stay), then a steady-lane step on the shorter schedule
(every stayer advances by its scheduled count, then the rows).  Applying them so
reaches :func:`protocol.plan.prepare`'s state and digest -- the digest is a sum of
the final state's terms -- without the general planner.

Two phases, as :meth:`ReplicaState.apply`: :func:`drop_lane` checks the shape and
opens a new :class:`SteadyLane` over the shorter schedule, its lists made from the
state's (after settling the old lane, which changes nothing the state means); the
caller runs the step's rows on that lane, which checks them and the digest without
touching the state; only then :func:`commit_drop` writes the finish into the state
and the new lane replaces the old.  A refusal in between leaves the state as it was.

Contract: the caller settles nothing itself and uses the returned lane only after
:func:`commit_drop`, or drops it.  The new lane keeps the finished ids for the state's
step fields (when it settles after that one step).
"""

from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from protocol import digest as dg
from protocol.lane import SteadyLane
from protocol.lane_lists import dot
from protocol.request import IntArray

if TYPE_CHECKING:
    from protocol.state import ReplicaState

#: finishes up to this many read their digest terms one by one; more, by column gathers
FEW_FINISHED = 8


class DropPlan(NamedTuple):
    """What :func:`commit_drop` writes: the finished handles, the shorter schedule and
    its counts (read-only arrays), their schedule term and the digest after the finish;
    and which positions of the old schedule stay (for the caller's own lists)."""

    finished: list[int]
    schedule: IntArray
    nsched: IntArray
    term: int
    digest: int
    keep: list[bool]


def drop_lane(lane: SteadyLane, finished: list[int], drop: list[int],
              keep: list[bool] | None = None, ids: frozenset[str] | None = None,
              ) -> tuple[SteadyLane, DropPlan] | None:
    """Phase one of a finish step: (a lane over the schedule less positions ``drop``, not
    yet the state's, and the plan of the finish) when ``drop`` is increasing and names
    exactly the scheduled ``finished`` handles (sorted, as a body sends them); None,
    nothing changed but the old lane settled, for any other shape (the general
    path decides, refusals included).  A caller that made them from ``drop`` and the
    handles passes the schedule's stay mask ``keep`` (False at ``drop``) and the
    finished handles' request ``ids``; else they are made here."""
    known = _known_lists(lane)
    lane.settle()
    state = lane.state
    current = lane.version == state.version  # the lane's handles and counts are the state's
    sched = lane.handles if current else state.schedule.tolist()
    n = len(sched)
    if not drop or drop[0] < 0 or drop[-1] >= n or any(map(int.__ge__, drop, drop[1:])) \
            or sorted(map(sched.__getitem__, drop)) != finished:
        return None
    if keep is None:
        keep = [True] * n
        for p in drop:
            keep[p] = False
    comp, lengths, keys = (None if x is None else list(compress(x, keep)) for x in known)
    handles = list(compress(sched, keep))
    nsched = list(compress(lane.nsched if current else state.nsched.tolist(), keep))
    schedule = np.array(handles, dtype=np.int64)
    counts = np.array(nsched, dtype=np.int64)
    schedule.flags.writeable = counts.flags.writeable = False  # shared, never edited
    term = dg.schedule_term(handles, nsched)
    before = _schedule_term(lane) if current else state.schedule_term()
    digest = (state.digest - _terms(state, finished) - before + term) & dg.MASK
    new = SteadyLane(state)
    new.handles, new.groups, new.keys = handles, state.kv_groups, keys
    new.journal = [[] for _ in range(state.kv_groups)]
    new._lengths = [lengths] if lengths is not None else \
        [table.lengths[schedule].tolist() for table in state.blocks]
    new.nsched, new.segments, new.extra = nsched, [[nsched, 0]], [0] * len(handles)
    # the stayers' computed counts stay
    new._base = comp if comp is not None else state.cols.computed[schedule].tolist()
    new.advance = dg.computed_change(handles, nsched)
    new.digest, new.version = digest, state.version  # (no reopen before its first step)
    new.finished = ids if ids is not None else \
        frozenset(state.handle_of(h).req_id for h in finished)
    return new, DropPlan(finished, schedule, counts, term, digest, keep)


def _known_lists(lane: SteadyLane) -> tuple[list[int] | None, list[int] | None,
                                            list[int] | None]:
    """The lane's computed counts, table lengths (one KV group) and count keys by
    position, where it holds them current (before its settle, which leaves them as they
    are)."""
    if lane.steps == 0 and lane.version != lane.state.version:
        return None, None, None  # not open on the state as it is
    lengths = lane._lengths
    return lane.comp, None if lengths is None or len(lengths) != 1 else lengths[0], lane.keys


def _schedule_term(lane: SteadyLane) -> int:
    """The schedule term of the (settled) lane's schedule, from its lists: by its
    schedule keys when it keeps them (``(count + 1) * key`` summed), else one C loop
    (the state's own term may be stale: the settle replaced its counts)."""
    if lane.skeys is not None:
        return (dot(lane.nsched, lane.skeys) + sum(lane.skeys)) & dg.MASK
    return dg.schedule_term(lane.handles, lane.nsched)


def _terms(state: ReplicaState, finished: list[int]) -> int:
    """The digest terms of the ``finished`` handles (settled): spec, tokens, computed
    count and blocks, mod 2**64 -- scalar reads for a few handles, column gathers for
    more (a batch that ends together)."""
    cols = state.cols
    if len(finished) <= FEW_FINISHED:
        return sum(cols.spec_term.item(h) + cols.token_sum.item(h)
                   + dg.handle_key_int(h) * cols.computed.item(h)
                   + sum(cols.block_sum.item(g, h) for g in range(state.kv_groups))
                   for h in finished) & dg.MASK
    hs = np.array(finished, dtype=np.int64)
    return (dg.total(cols.spec_term[hs]) + dg.total(cols.token_sum[hs])
            + dg.total(dg.computed_terms(hs, cols.computed[hs]))
            + dg.total(cols.block_sum[:, hs].ravel())) & dg.MASK


def commit_drop(lane: SteadyLane, plan: DropPlan) -> None:
    """Phase two: the finish written into the state (cannot fail); ``lane``, the one
    :func:`drop_lane` opened and the step's rows were taken by, is the state's lane."""
    lane.state.commit_drop(plan.finished, plan.schedule, plan.nsched, plan.term, plan.digest)
    lane.version = lane.state.version
