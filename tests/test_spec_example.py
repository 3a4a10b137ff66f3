"""SPEC.md's §14 worked example, replayed: its printed bytes, digests and events stay
real (and §9's desynced in-order delta, shown with the example's frames)."""

from __future__ import annotations

import copy
import hashlib
import re
from typing import Any

import numpy as np
import pytest
from spec_text import MASK64, read_spec, section, squash

from engine_side.mirror import EngineMirror
from engine_side.request_diff import RequestDiffer
from protocol import digest as dg
from protocol.codec import decode, encode
from protocol.messages import Delta, Heartbeat, Snapshot, SnapshotRequest
from protocol.params import SamplingSpec
from protocol.rebuild import rebuild_request
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec, requests_equal
from protocol.state import ReplicaState
from worker_side import events as ev
from worker_side.replica import State, WorkerReplica


@pytest.fixture(scope="module")
def spec() -> str:
    return read_spec()


# -- §14: the worked example, replayed -------------------------------------------------------
def _example_request(step: int, specs: list[RequestSpec]) -> ExecuteModelRequest:
    counts = [10, 6] if step == 1 else [1, 1]
    computed = [0, 0] if step == 1 else [8 + step, 4 + step]
    tables = [[5, 6] if step == 8 else [5], [9]]
    return ExecuteModelRequest(
        ["a", "b"], specs, np.array(counts, dtype=np.int64),
        np.array(computed, dtype=np.int64), (Ragged.from_lists(tables),),
        Ragged.empty(2), Ragged.empty(2))


def _example_specs() -> list[RequestSpec]:
    return [RequestSpec("a", np.arange(100, 110, dtype=np.int64), SamplingSpec(temperature=0.0)),
            RequestSpec("b", np.arange(200, 206, dtype=np.int64), SamplingSpec(max_tokens=64))]


def _worked_example() -> tuple[EngineMirror, list[bytes], list[ExecuteModelRequest]]:
    """§14's engine side: two requests, prefill, then decode steps 2..8."""
    specs = _example_specs()
    mirror = EngineMirror(epoch=7)
    differ = RequestDiffer(mirror)
    frames, requests = [], []
    for step in range(1, 9):
        requests.append(_example_request(step, specs))
        (frame,) = encode(differ.diff(requests[-1]))
        frames.append(bytes(frame))
    return mirror, frames, requests


def _delta(frame: bytes) -> Delta:
    msg = decode([frame])
    assert isinstance(msg, Delta)
    return msg


def _events(events: list[ev.Event]) -> str:
    """Events as §14 writes them: ``Name(arg, ...)``, strings quoted."""
    def arg(v: Any) -> str:
        return f'"{v}"' if isinstance(v, str) else str(v)
    return ", ".join(f"{type(e).__name__}({', '.join(arg(v) for v in vars(e).values())})"
                     for e in events)


def _one(msg: Any) -> bytes:
    (frame,) = encode(msg)
    return bytes(frame)


def test_worked_example_replays(spec: str) -> None:
    text = section(spec, "## 14. Worked example", "## 15.")
    flat = squash(text)
    mirror, frames, requests = _worked_example()
    deltas = [_delta(f) for f in frames]
    w1, w2 = WorkerReplica(), WorkerReplica()

    def feed(w: WorkerReplica, msg: Any) -> str:
        return _events(w.receive(decode([_one(msg)]), 0.0))

    # 1-2. W1 joins
    assert f"`{_one(Heartbeat(7, 0, 0)).hex(' ')}`" in text
    assert feed(w1, Heartbeat(7, 0, 0)) == "" and w1.state is State.AWAITING_SNAPSHOT
    assert _events(w1.poll(0.0)) in flat
    assert f"`{_one(SnapshotRequest(w1.epoch, w1.seq, rank=0)).hex(' ')}`" in text
    empty = EngineMirror(epoch=7).snapshot()
    assert f"{len(_one(empty))} B. W1: {feed(w1, empty)}" in flat
    # 3. step 1, printed in full in a code block
    block = re.search(r"```\n(.*?)```", text, re.S)
    assert block is not None and bytes.fromhex(block.group(1)) == frames[0]
    assert f"Delta seq 1, {len(frames[0])} B" in flat
    assert f"W1: {feed(w1, deltas[0])}" in flat
    _check_step_one_terms(flat)
    # 4-5. steps 2 and 3 printed in full
    for step in (2, 3):
        assert f"Delta seq {step}, {len(frames[step - 1])} B" in flat.replace("**", "")
        assert f"`{frames[step - 1].hex(' ')}`" in text
        assert f"W1: {feed(w1, deltas[step - 1])}" in flat
    assert f"`{deltas[2].digest:#018x}`" in text
    assert all(len(f) == 14 for f in frames[2:7]) and "Steps 4–7 are 14 B each" in flat
    # 6. late joiner W2
    feed(w1, deltas[3])
    assert f"Its first message is Delta 4: {feed(w2, deltas[3])}" in flat
    assert f"`{_one(SnapshotRequest(w2.epoch, w2.seq, rank=1)).hex(' ')}`" in text
    snap4 = _snapshot_at(4)
    assert f"Snapshot seq 4 ({len(_one(snap4))} B" in flat
    assert f"W1 {feed(w1, deltas[4])}; W2 {feed(w2, deltas[4])}" in flat
    assert f"reaches W2: {feed(w2, snap4)} →" in flat and w2.seq == 5
    # 7. Delta 6 lost on the way to W1
    assert f"(W2: {feed(w2, deltas[5])})" in flat
    retransmit = copy.deepcopy(w1)
    assert f"Delta 7: W1 {feed(w1, deltas[6])} →" in flat and w1.state is State.DESYNCED
    assert f"; W2 {feed(w2, deltas[6])}." in flat
    request = SnapshotRequest(w1.epoch, w1.seq, rank=0)
    assert f"(`{_one(request).hex(' ')}`)" in text
    snap7 = _snapshot_at(7)
    assert f"Snapshot seq 7 ({len(_one(snap7))} B): W1 {feed(w1, snap7)} →" in flat
    retransmit.receive(decode([frames[6]]), 0.0)  # the same Delta 7, buffered
    assert f"Delta 7: {_events(retransmit.receive(deltas[5], 0.0))} → `synced`" in flat
    # 8. step 8
    assert f"Delta seq 8, {len(frames[7])} B" in flat
    assert f"W1, W2: {feed(w1, deltas[7])}" in flat and feed(w2, deltas[7]) == "Applied(8)"
    assert w1.data is not None and w2.data is not None
    assert w1.data.digest == w2.data.digest == mirror.state.digest
    assert f"`{mirror.state.digest:#018x}`" in text
    for w in (w1, w2):
        assert w.data is not None and w.applied is not None and w.last is not None
        assert requests_equal(rebuild_request(w.data, w.last.body, w.applied, {}), requests[7])


def _snapshot_at(seq: int) -> Snapshot:
    specs = _example_specs()
    mirror = EngineMirror(epoch=7)
    differ = RequestDiffer(mirror)
    for step in range(1, seq + 1):
        differ.diff(_example_request(step, specs))
    return mirror.snapshot()


def _check_step_one_terms(flat: str) -> None:
    """§14 step 3 decomposes the digest after step 1 into §5's terms."""
    mirror = EngineMirror(epoch=7)
    RequestDiffer(mirror).diff(_example_request(1, _example_specs()))
    state = mirror.state
    assert state.tables is not None
    total = 0
    for h in (0, 1):
        request = state.requests[h]
        assert request is not None
        raw = bytes(request.spec)
        b = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
        term = dg.mix64_int(b ^ (h * dg.K_SPEC & MASK64))
        assert f"`spec({h}) = {term:#018x}` (`B({h}) = {b:#018x}`" in flat
        assert f"{len(raw)} spec bytes" in flat or f"{len(raw)} bytes" in flat
        block = state.tables[0].row(h).tolist()[0]
        bterm = dg.mix64_int((block * dg.K_SPEC + h * dg.K_HANDLE + dg.K_ROW) & MASK64)
        assert f"`block({h},0,0) = {bterm:#018x}`" in flat
        total += term + bterm
    sched = [(int(c) + 1, dg.schedule_key(h, i)) for i, (h, c)
             in enumerate(zip(state.schedule.tolist(), state.nsched.tolist(), strict=True))]
    assert f"`sched(0) = {sched[0][0]} * {sched[0][1]:#x}`" in flat
    assert f"`sched(1) = {sched[1][0]} * {sched[1][1]:#x}`" in flat
    total += sum(n * k for n, k in sched)
    assert total & MASK64 == state.digest and f"`{state.digest:#018x}`" in flat
    assert not state.cols.computed[:2].any()  # "the computed terms are 0"


# -- §9 with the example's frames --------------------------------------------------------------
def test_desynced_in_order_delta_applies_and_drains() -> None:
    """§9: (desynced, delta_in_order) applies, then drains the buffer (§8.2 rule 7)."""
    _, frames, _ = _worked_example()
    deltas = [_delta(f) for f in frames]
    w = WorkerReplica(start=(7, ReplicaState()))
    assert w.receive(deltas[0], 0.0) == [ev.Applied(1)]
    out = w.receive(deltas[2], 0.0)
    assert out[0] == ev.GapDetected(2, 3) and w.state is State.DESYNCED
    assert w.receive(deltas[1], 0.0) == [ev.Applied(2), ev.Applied(3)]
    assert w.state is State.SYNCED and w.seq == 3
