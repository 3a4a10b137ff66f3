"""The tests' oracle of whole requests (protocol major 3): what ``verify=True`` used to do.

:class:`RecordingMirror` is an :class:`EngineMirror` that remembers the last step's
:class:`Applied` record (``RequestDiffer.diff`` returns the Delta only); :class:`Oracle`
diffs whole requests through a :class:`RequestDiffer` and checks that
:func:`protocol.rebuild.rebuild_request` of the mirror's state gives the request back;
:func:`replica_request` rebuilds the request of the step a :class:`WorkerReplica` just
applied (the old ``WorkerReplica.request()``).
"""

from __future__ import annotations

from typing import Any

from engine_side.mirror import EngineMirror
from engine_side.request_diff import RequestDiffer
from protocol.columns import HandleColumns
from protocol.messages import Delta, NewRequest
from protocol.rebuild import rebuild_request
from protocol.request import ExecuteModelRequest, RequestSpec, request_differences
from protocol.state import Applied, ReplicaState
from worker_side.replica import State, WorkerReplica

Cache = dict[int, tuple[NewRequest, RequestSpec]]


class RecordingMirror(EngineMirror):
    """An EngineMirror keeping the last step's (Delta, Applied)."""

    last: Delta | None = None
    applied: Applied | None = None

    def step(self, *args: Any, **kwargs: Any) -> tuple[Delta, Applied]:
        delta, applied = super().step(*args, **kwargs)
        self.last, self.applied = delta, applied
        return delta, applied


class Oracle:
    """A RecordingMirror diffed by a RequestDiffer; ``check`` compares every rebuilt step
    with the request it came from (``verify=True`` of protocol major 2)."""

    def __init__(self, *args: Any, check: bool = True, **kwargs: Any) -> None:
        self.mirror = RecordingMirror(*args, **kwargs)
        self.differ = RequestDiffer(self.mirror)
        self.check = check
        self.cache: Cache = {}

    def diff(self, request: ExecuteModelRequest) -> Delta:
        delta = self.differ.diff(request)
        if self.check:
            differences = request_differences(self.rebuild(), request)
            assert differences == [], f"the mirror's state rebuilds another request: {differences}"
        return delta

    def rebuild(self) -> ExecuteModelRequest:
        """The whole request of the mirror's last step."""
        m = self.mirror
        assert m.last is not None and m.applied is not None
        return rebuild_request(m.state, m.last.body, m.applied, self.cache)


def replica_request(replica: WorkerReplica, cache: Cache | None = None) -> ExecuteModelRequest:
    """The request of the delta ``replica`` applied last (right after an Applied while
    SYNCED, as a receiver builds its step)."""
    assert replica.state is State.SYNCED and replica.data is not None
    assert replica.applied is not None and replica.last is not None, "no step applied"
    return rebuild_request(replica.data, replica.last.body, replica.applied,
                           {} if cache is None else cache)


def state_fingerprint(state: ReplicaState) -> tuple[Any, ...]:
    """Everything a ReplicaState holds, as plain values: the digest and its cached sums,
    the schedule and its counts, every handle column (capacity included), the requests
    and specs by handle, every block table and token history (arrays and lengths)."""
    cols = state.cols
    tables = [] if state.tables is None else [(t.table.tolist(), t.lengths.tolist())
                                              for t in state.tables]
    tokens = None if state.tokens is None else (state.tokens.table.tolist(),
                                                state.tokens.lengths.tolist())
    return (state.digest, state.sched_term, state.advance, state.schedule.tolist(),
            state.nsched.tolist(),
            {name: getattr(cols, name).tolist() for name in
             (*HandleColumns._FLAT, "block_len", "block_sum")},
            [None if r is None else id(r) for r in state.requests],
            [None if s is None else id(s) for s in state.specs], tables, tokens)
