"""The finish step on the engine: requests of the last batch finish, the rest stay.

Theory of operation
-------------------
Requests finish one or a few at a time, so the step after a finish is vLLM's
commonest turnover: the last batch less the finished requests, in its order, and
nothing joining.  Its body is the general path's (``finished`` handles, the
``schedule_drop`` of their positions) plus exactly what a same-batch step of the
stayers would carry (count departures from the forecast, appends, drafts, flags, the
output departures), so it is built as one: the stayers' forecast lists are cut out
of the batch's, the same C scan reads the step against them, and the mirror takes
the finish and the stayers' lane step (:mod:`protocol.lane_drop`) instead of the
general planner.  The bytes are the general path's (the tests compare the paths).

Anything else -- a finished request that was not in the last batch, one that left
without finishing, a join, a preemption, any rare field, several KV groups, a store,
the mirror's ``verify`` mode, no speedups -- returns None before anything changes
but the lane's settle, and the turnover or general path runs.
"""

from __future__ import annotations

from itertools import compress, repeat
from typing import TYPE_CHECKING, Any, NamedTuple

from engine_side.vllm.forecast import Forecast
from engine_side.vllm.quick import Scan, scan_fields, scan_rows
from engine_side.vllm.rare import PLAIN, RARE_NAMES
from protocol import codec
from protocol.codec import Frame
from protocol.lane import SteadyLane
from protocol.lane_drop import commit_drop, drop_lane
from protocol.messages import Delta, DeltaBody
from protocol.packing import pack_uints
from protocol.speedups import C as _C

if TYPE_CHECKING:
    from engine_side.vllm.encoder import SchedulerOutputEncoder

_FINISHED = 1  # the index of finished_req_ids in the rare fields (rare.RARE_FIELDS)


class Kept(NamedTuple):
    """A batch's lists at the stayers' positions, as the C scan reads a batch."""

    drop: list[int]  # the positions that leave, increasing
    keep: list[bool]  # False at those positions
    batch: list[str]
    pos: dict[str, int]
    handles: list[int]
    forecast: Forecast


def finish_delta(enc: SchedulerOutputEncoder, so: Any) -> list[Frame] | None:
    """The frames of ``so`` when it is a finish step, the mirror, its lane and the
    encoder's memory advanced as the general path advances them; None, nothing changed
    but the lane settled, for any other step."""
    kept = _kept(enc, so)
    if kept is None:
        return None
    quick = enc.quick
    assert _C is not None  # noqa: S101 - checked by _kept
    fc = kept.forecast
    plain = (*PLAIN[:_FINISHED], so.finished_req_ids, *PLAIN[_FINISHED + 1:])
    scan: Scan | None = _C.same_batch_scan(
        so, kept.batch, kept.pos, fc.basis(), fc.nsched, fc.total, fc.plen_less_one,
        kept.handles, RARE_NAMES, plain, True)
    if scan is None:
        return None
    finished = sorted(map(quick.handles.__getitem__, kept.drop))
    opened = drop_lane(enc.lane, finished, kept.drop,  # type: ignore[arg-type]
                       kept.keep, frozenset(so.finished_req_ids))
    if opened is None:
        return None
    lane, plan = opened
    body = DeltaBody(finished=pack_uints(finished), schedule_drop=pack_uints(kept.drop),
                     **scan_fields(scan))
    digest = lane.step(body, [] if scan[2] is None else [scan[2]], rows=scan_rows(scan),
                       own_appends=True, own_rows=True)
    if digest is None:
        return None  # the lane does not take the rows: the general path decides
    commit_drop(lane, plan)
    return _taken(enc, so, kept, scan, lane, body, digest)


def _kept(enc: SchedulerOutputEncoder, so: Any) -> Kept | None:
    """The quick encoder's lists at the stayers' positions and their forecast, made
    without changing them, when ``so`` schedules exactly the last batch less its finished
    requests, in order, and nothing else joins or leaves; else None."""
    quick, mirror = enc.quick, enc.mirror
    finished = so.finished_req_ids
    if _C is None or not quick.ready or mirror is None or mirror.verify or \
            enc.items is not None or enc.kv_groups != 1 or so.scheduled_new_reqs or \
            not finished or type(finished) is not set or len(finished) >= len(quick.batch):
        return None
    stay = so.scheduled_cached_reqs.req_ids
    if type(stay) is not list or len(stay) + len(finished) != len(quick.batch):
        return None
    drop = sorted(map(quick.pos.get, finished, repeat(-1)))  # (a few: found by id)
    if drop[0] < 0:
        return None  # a finished request the last batch did not hold
    keep = [True] * len(quick.batch)
    for p in drop:
        keep[p] = False
    batch = list(compress(quick.batch, keep))
    if batch != stay:
        return None  # a stayer out of order, repeated, unknown or finished as well
    return Kept(drop, keep, batch, dict(zip(batch, range(len(batch)), strict=True)),
                list(compress(quick.handles, keep)), quick.forecast.kept(keep))


def _taken(enc: SchedulerOutputEncoder, so: Any, kept: Kept, scan: Scan, lane: SteadyLane,
           body: DeltaBody, digest: int) -> list[Frame]:
    """The finish step is the mirror's: its memory, the quick encoder's lists and the
    encoder's own advanced; the frames."""
    mirror, quick = enc.mirror, enc.quick
    assert mirror is not None  # noqa: S101 - checked by _kept
    finished = sorted(so.finished_req_ids)
    freed = [(rid, mirror.handles[rid]) for rid in finished]
    enc.lane = lane
    seq = mirror.finish_taken(freed)
    enc._file_blocks()  # (the noted appends of the finished requests too, before they go)
    enc.forget(so.finished_req_ids)
    # (the memory of the last batch keeps the finished ids, which never come back as
    # cached requests; the last general step's tables still hold the stayers' rows)
    quick.batch, quick.pos, quick.handles = kept.batch, kept.pos, kept.handles
    quick.index = list(range(len(kept.batch)))
    quick.forecast = kept.forecast
    quick.scanned(scan)
    enc._quick_taken(seq)
    enc.finish_steps += 1
    return codec.encode(Delta(mirror.epoch, seq, digest, body))
