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

from itertools import compress, repeat
from operator import contains, not_
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from protocol import digest as dg
from protocol.lane import SteadyLane
from protocol.request import IntArray

if TYPE_CHECKING:
    from protocol.state import ReplicaState


class DropPlan(NamedTuple):
    """What :func:`commit_drop` writes: the finished handles, the shorter schedule and
    its counts (read-only arrays), their schedule term and the digest after the finish."""

    finished: list[int]
    schedule: IntArray
    nsched: IntArray
    term: int
    digest: int


def drop_lane(lane: SteadyLane, finished: list[int], drop: list[int],
              ) -> tuple[SteadyLane, DropPlan] | None:
    """Phase one of a finish step: (a lane over the schedule less positions ``drop``, not
    yet the state's, and the plan of the finish) when ``drop`` is increasing and names
    exactly the scheduled ``finished`` handles (sorted, as a body sends them); None,
    nothing changed but the old lane settled, for any other shape (the general
    path decides, refusals included)."""
    lane.settle()
    state = lane.state
    sched = state.schedule.tolist()
    n = len(sched)
    if not drop or drop[0] < 0 or drop[-1] >= n or any(map(int.__ge__, drop, drop[1:])) \
            or sorted(map(sched.__getitem__, drop)) != finished:
        return None
    leaving = set(drop)
    keep = list(map(not_, map(contains, repeat(leaving), range(n))))
    handles = list(compress(sched, keep))
    nsched = list(compress(state.nsched.tolist(), keep))
    cols = state.cols
    lost = sum(cols.spec_term.item(h) + cols.token_sum.item(h)
               + dg.handle_key_int(h) * cols.computed.item(h)
               + sum(cols.block_sum.item(g, h) for g in range(state.kv_groups))
               for h in finished)
    term = dg.schedule_term(handles, nsched)
    digest = (state.digest - lost - state.schedule_term() + term) & dg.MASK
    schedule = np.array(handles, dtype=np.int64)
    counts = np.array(nsched, dtype=np.int64)
    schedule.flags.writeable = counts.flags.writeable = False  # shared, never edited
    new = _opened(state, handles, nsched, schedule, digest)
    new.finished = frozenset(state.handle_of(h).req_id for h in finished)
    return new, DropPlan(finished, schedule, counts, term, digest)


def _opened(state: ReplicaState, handles: list[int], nsched: list[int], schedule: IntArray,
            digest: int) -> SteadyLane:
    """A lane open on ``handles`` as the state will hold them after the finish (its
    version the state's now: nothing reopens it before its first step)."""
    lane = SteadyLane(state)
    lane.handles, lane.groups = handles, state.kv_groups
    lane.journal = [[] for _ in range(state.kv_groups)]
    lane._lengths = [table.lengths[schedule].tolist() for table in state.blocks]
    lane.nsched, lane.segments = nsched, [[nsched, 0]]
    lane.extra = [0] * len(handles)
    lane._base = state.cols.computed[schedule].tolist()  # the stayers' counts stay
    lane.advance = dg.computed_change(handles, nsched)
    lane.digest, lane.version = digest, state.version
    return lane


def commit_drop(lane: SteadyLane, plan: DropPlan) -> None:
    """Phase two: the finish written into the state (cannot fail); ``lane``, the one
    :func:`drop_lane` opened and the step's rows were taken by, is the state's lane."""
    lane.state.commit_drop(plan.finished, plan.schedule, plan.nsched, plan.term, plan.digest)
    lane.version = lane.state.version
