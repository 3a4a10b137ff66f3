"""Whole-state snapshots: build one from a state that keeps its tables, load one.

A snapshot carries every live request as it was added (its spec bytes and tensors)
with its current computed count and token history, each KV group's tables keyed by
handle, and the schedule with its counts.  Loading replays it as one Delta onto an
empty state -- the same code path as every step -- and then checks the digest.
"""

from __future__ import annotations

import msgspec

from protocol.errors import InvalidDelta, LocalProtocolError
from protocol.messages import (
    TOKEN_MODE_ENGINE,
    DeltaBody,
    RareBody,
    Rows,
    Snapshot,
    SnapshotBody,
)
from protocol.packing import pack_uints, unpack_uint_list
from protocol.state import ReplicaState


def build_snapshot(state: ReplicaState, epoch: int, seq: int) -> Snapshot:
    """The whole state at ``seq`` (live requests in handle order)."""
    tables = state.tables
    if tables is None:
        raise LocalProtocolError("a snapshot needs a state that keeps its block tables")
    live = state.live_handles().tolist()
    requests = []
    for h in live:
        new = state.requests[h]
        assert new is not None  # live
        toks = state.token_history(h)
        requests.append(msgspec.structs.replace(
            new, computed=int(state.cols.computed[h]),
            output=pack_uints(toks) if toks.size else b""))
    blocks = []
    for table in tables:
        rows = [table.row(h).tolist() for h in live]
        blocks.append(Rows(keys=pack_uints(live), counts=pack_uints([len(r) for r in rows]),
                           values=pack_uints([b for r in rows for b in r])))
    body = SnapshotBody(token_mode=state.token_mode, kv_groups=state.kv_groups,
                        requests=tuple(requests), blocks=tuple(blocks),
                        schedule=pack_uints(state.schedule),
                        scheduled_tokens=pack_uints(state.nsched))
    return Snapshot(epoch=epoch, seq=seq, digest=state.digest, body=body)


def load_snapshot(snap: Snapshot) -> ReplicaState:
    """A fresh state equal to the snapshot's; InvalidDelta (or MalformedMessage) if it
    is inconsistent or its digest differs."""
    body = snap.body
    if body.token_mode not in (0, 1) or not 1 <= body.kv_groups <= 64:
        raise InvalidDelta("bad snapshot parameters", token_mode=body.token_mode,
                           kv_groups=body.kv_groups)
    if len(body.blocks) not in (0, body.kv_groups):
        raise InvalidDelta("snapshot blocks must have one entry per KV group")
    state = ReplicaState(body.token_mode, body.kv_groups)
    # 1. the requests, scheduled in handle order so their tables can be written as rows
    handles = [r.handle for r in body.requests]
    if handles != sorted(set(handles)) or (handles and handles[0] < 0):
        raise InvalidDelta("snapshot requests must be in ascending handle order, from 0")
    if body.token_mode != TOKEN_MODE_ENGINE and any(r.output for r in body.requests):
        raise InvalidDelta("snapshot tokens in worker-token mode")
    replace = []
    for rows in body.blocks:
        keys = unpack_uint_list(rows.keys) if rows.keys else []
        at = {h: i for i, h in enumerate(handles)}
        if any(k not in at for k in keys):
            raise InvalidDelta("snapshot blocks name a handle that is not live")
        replace.append(Rows(keys=pack_uints([at[k] for k in keys]), counts=rows.counts,
                            values=rows.values))
    counts = pack_uints([0] * len(handles))
    state.apply(DeltaBody(added=body.requests, schedule_append=pack_uints(handles),
                          scheduled_tokens=Rows(keys=pack_uints(range(len(handles))),
                                                values=counts) if handles else None,
                          rare=RareBody(block_replace=tuple(replace))))
    # 2. the real schedule and counts (no step advanced anything: counts were 0)
    sched = unpack_uint_list(body.schedule) if body.schedule else []
    nsched = unpack_uint_list(body.scheduled_tokens) if body.scheduled_tokens else []
    if len(sched) != len(nsched):
        raise InvalidDelta("snapshot schedule and token counts differ in length")
    state.apply(DeltaBody(rare=RareBody(schedule_full=pack_uints(sched)),
                          scheduled_tokens=Rows(keys=pack_uints(range(len(sched))),
                                                values=pack_uints(nsched))))
    if state.digest != snap.digest:
        raise InvalidDelta("snapshot digest mismatch", expected=snap.digest, got=state.digest)
    return state
