"""The one state machine, driven through the core API: every step's body rebuilds, on a
receiver that decodes the frames, exactly the state the engine meant, and both ends
agree on the digest, which equals its from-scratch recomputation."""

from __future__ import annotations

from typing import Any

from core_streams import core_streams, spec_of
from hypothesis import given, settings

from engine_side.mirror import EngineMirror, Entry
from protocol import codec
from protocol.messages import TOKEN_MODE_ENGINE, TOKEN_MODE_WORKER, Delta, Snapshot
from protocol.snapshot import build_snapshot, load_snapshot
from protocol.state import ReplicaState


def _run(stream: dict[str, Any]) -> None:
    mode = TOKEN_MODE_ENGINE if stream["engine_tokens"] else TOKEN_MODE_WORKER
    mirror = EngineMirror(token_mode=mode, kv_groups=stream["kv_groups"])
    worker = ReplicaState(mode, stream["kv_groups"])
    for step in stream["steps"]:
        kw = dict(step["kwargs"])
        kw["added"] = [Entry(spec_of(req, t), req.computed,
                             req.tokens if stream["engine_tokens"] else None)
                       for req, t in kw["added"]]
        delta, _ = mirror.step(kw.pop("batch"), kw.pop("nsched"), **kw)
        msg = codec.decode(codec.encode(delta))
        assert isinstance(msg, Delta)
        worker.apply(msg.body, msg.digest)
        assert worker.digest == mirror.state.digest == worker.recompute_digest()
        _same_as_expected(worker, step["expect"])
        snap = codec.decode(codec.encode(build_snapshot(mirror.state, 1, delta.seq)))
        assert isinstance(snap, Snapshot)
        loaded = load_snapshot(snap)
        assert loaded.digest == worker.digest
        _same_as_expected(loaded, step["expect"])


def _same_as_expected(state: ReplicaState, want: dict[str, Any]) -> None:
    sched = state.schedule.tolist()
    assert [state.spec_of(h).req_id for h in sched] == want["batch"]
    assert state.nsched.tolist() == want["nsched"]
    assert state.cols.computed[state.schedule].tolist() == want["computed"]
    assert state.tables is not None
    assert [[state.tables[g].row(h).tolist() for g in range(state.kv_groups)]
            for h in sched] == want["tables"]
    if want["tokens"] is not None:
        assert [state.token_history(h).tolist() for h in sched] == want["tokens"]
    assert sorted(state.spec_of(h).req_id for h in state.live_handles().tolist()) == want["live"]


@settings(max_examples=300, deadline=None)
@given(stream=core_streams())
def test_core_streams_apply_exactly(stream: dict[str, Any]) -> None:
    _run(stream)
