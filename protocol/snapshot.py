"""Whole-state snapshots: build one from a state, load one into a fresh state."""

from __future__ import annotations

import numpy as np

from protocol import digest as dg
from protocol.errors import InvalidDelta
from protocol.messages import TOKEN_MODE_ENGINE, NewRequest, Rows, Snapshot, SnapshotBody
from protocol.packing import pack_uints
from protocol.plan import _Planner
from protocol.request import IntArray
from protocol.state import ReplicaState


def _request(state: ReplicaState, h: int) -> NewRequest:
    spec = state.handle_of(h)
    prompt = spec.prompt_token_ids
    buf = state.tokens[h] if h < len(state.tokens) else None
    return NewRequest(
        handle=h, req_id=spec.req_id,
        prompt=b"" if prompt is None else pack_uints(prompt), prompt_none=prompt is None,
        sampling=spec.sampling, pooling=spec.pooling, lora=spec.lora,
        mm_features=spec.mm_features, prompt_embeds=spec.prompt_embeds,
        prompt_is_token_ids=spec.prompt_is_token_ids,
        num_computed=int(state.cols.computed[h]),
        output=b"" if buf is None else pack_uints(buf.view()),
    )


def _blocks(state: ReplicaState, handles: IntArray, g: int) -> Rows:
    tables = [state.blocks[g][h] for h in handles.tolist()]
    values = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int64)
    return Rows(handles=pack_uints(handles), counts=pack_uints([t.size for t in tables]),
                values=pack_uints(values))


def build_snapshot(state: ReplicaState, epoch: int, seq: int) -> Snapshot:
    """The whole state at ``seq`` (live requests in handle order)."""
    live = state.live_handles()
    body = SnapshotBody(
        token_mode=state.token_mode, kv_groups=state.kv_groups,
        requests=tuple(_request(state, h) for h in live.tolist()),
        blocks=tuple(_blocks(state, live, g) for g in range(state.kv_groups)),
        schedule=pack_uints(state.schedule), scheduled_tokens=pack_uints(state.nsched),
    )
    return Snapshot(epoch=epoch, seq=seq, digest=state.digest, body=body)


def load_snapshot(snap: Snapshot) -> ReplicaState:
    """A fresh state equal to the snapshot's; InvalidDelta if it is inconsistent."""
    body = snap.body
    if body.token_mode not in (0, 1) or not 1 <= body.kv_groups <= 64:
        raise InvalidDelta("bad snapshot parameters", token_mode=body.token_mode)
    state = ReplicaState(body.token_mode, body.kv_groups)
    planner = _Planner(state, _as_delta(body))
    for a in planner.adds():
        tokens = a.tokens if body.token_mode == TOKEN_MODE_ENGINE else None
        state._install(a.handle, a.spec, a.spec_hash, a.computed, tokens)
    _load_blocks(state, body, planner)
    sched = planner.schedule() if body.schedule else state.schedule
    nsched = _unpack(body.scheduled_tokens)
    if nsched.size != sched.size:
        raise InvalidDelta("snapshot schedule and token counts differ in length")
    state.cols.in_sched[sched] = True
    state.cols.last_nsched[sched] = nsched
    nsched.flags.writeable = False
    state.schedule, state.nsched = sched, nsched
    state.digest = state.recompute_digest()
    if state.digest != snap.digest:
        raise InvalidDelta("snapshot digest mismatch", expected=snap.digest, got=state.digest)
    return state


def _as_delta(body: SnapshotBody):  # type: ignore[no-untyped-def]
    from protocol.messages import DeltaBody

    return DeltaBody(added=body.requests, schedule_full=body.schedule)


def _unpack(buf: bytes) -> IntArray:
    from protocol.packing import unpack_uints

    return unpack_uints(buf) if buf else np.zeros(0, dtype=np.int64)


def _load_blocks(state: ReplicaState, body: SnapshotBody, planner: _Planner) -> None:
    if len(body.blocks) not in (0, state.kv_groups):
        raise InvalidDelta("snapshot blocks must have one entry per KV group")
    for g, rows in enumerate(body.blocks):
        hs, counts, values = planner.rows(rows, state.schedule)
        planner.check_live(hs, "snapshot blocks")
        state.blocks[g].write(hs, np.zeros(hs.size, dtype=np.int64), counts, values)
        for h in hs.tolist():
            state.cols.block_sum[g, h] = dg.total(dg.block_terms(h, g, 0, state.blocks[g][h]))
