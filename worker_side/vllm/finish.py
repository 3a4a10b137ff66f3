"""Worker side of the finish step (engine_side/vllm/finish.py): requests of the last
batch finish, the rest stay in their order.

A body with ``finished`` handles and the ``schedule_drop`` of exactly their positions,
and otherwise a same-batch body of the stayers, is applied as its two edits
(:mod:`protocol.lane_drop`): a lane is opened over the shorter schedule and a quick
decoder over the stayers' lists, the stayers' step runs on them as any same-batch step
does (its checks and digest included), and only then do the finish, the lane and the
quick decoder become the decoder's.  The SchedulerOutput is the same-batch step's
with the finished ids; it equals the general path's (the tests compare the two).
Anything else returns None with nothing changed but the lane settled, and the
general path decides.
"""

from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING, Any

from msgspec.structs import replace

from engine_side.vllm.schema import StepExt
from protocol.lane import SteadyLane
from protocol.lane_drop import commit_drop, drop_lane
from protocol.messages import Delta
from protocol.packing import unpack_uint_list
from worker_side.vllm.quick import QuickDecoder, plain_body

if TYPE_CHECKING:
    from worker_side.vllm.decoder import SchedulerOutputDecoder


def finish_output(dec: SchedulerOutputDecoder, msg: Delta, ext: StepExt) -> Any:
    """The SchedulerOutput of ``msg`` (in order; ``ext`` its extension) when it is a
    finish step, the replica, its lane and the decoder's lists advanced; None, nothing
    changed but the lane settled, for any other body.  Raises InvalidDelta, nothing
    changed, when the stayers' step does not apply or its digest differs."""
    body, quick, state = msg.body, dec.quick, dec.state
    if state is None or state.kv_groups != 1 or dec.items is not None or not quick.ready:
        return None
    rows = replace(body, finished=b"", schedule_drop=b"")  # the stayers' step
    if not plain_body(rows, ext):
        return None
    try:
        finished, drop = unpack_uint_list(body.finished), unpack_uint_list(body.schedule_drop)
    except ValueError:
        return None  # malformed: the state's apply raises it, typed
    if len(drop) >= len(quick.batch) or finished != sorted(finished):
        return None
    opened = drop_lane(dec.lane, finished, drop)
    if opened is None:
        return None
    lane, plan = opened
    kept = _kept(quick, plan.keep, lane)
    so = kept.counted_step(lane, rows, ext, msg.digest)
    if so is None:
        fast = kept.lane_inputs(rows, ext)
        if fast is None or lane.step(rows, fast[0], msg.digest, fast[1]) is None:
            return None
        so = kept.scheduler_output(rows, ext, *fast)
    commit_drop(lane, plan)
    so.finished_req_ids = ids = set(lane.finished)
    _taken(dec, msg, ids, lane, kept)
    return so


def _kept(quick: QuickDecoder, keep: list[bool], lane: SteadyLane) -> QuickDecoder:
    """A quick decoder over ``quick``'s lists at the positions ``keep`` marks, the
    stayers' handles being ``lane``'s; ``quick`` unchanged."""
    kept = QuickDecoder(quick.types)
    kept.batch = list(compress(quick.batch, keep))
    kept.kv_groups = quick.kv_groups
    kept.at = dict(zip(lane.handles, range(len(lane.handles)), strict=True))
    kept.forecast = quick.forecast.kept(keep)
    kept.nsched = kept.forecast.nsched
    kept.nsched_map = dict(zip(kept.batch, kept.nsched, strict=True))
    kept.ready = True
    return kept


def _taken(dec: SchedulerOutputDecoder, msg: Delta, ids: set[str], lane: SteadyLane,
           kept: QuickDecoder) -> None:
    """The finish step is the decoder's: its lane, lists and memory advanced as the
    general path advances them."""
    dec.lane, dec.quick = lane, kept
    dec.mem.finish(ids)  # (its last batch keeps them: they never come back as cached)
    dec.set_last_lengths(kept.batch, dec._last_lengths)
    dec._lengths_stale = True  # (the last lengths are the old batch's: refreshed when read)
    dec._quick_step(msg.seq, bool(msg.body.block_append))
    dec.finish_steps += 1
