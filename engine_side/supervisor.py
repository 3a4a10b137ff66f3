"""The demo's worker supervisor: spawn worker processes, restart the dead, apply chaos.

Workers run in their own process group, so a Ctrl-C at the terminal reaches only the
engine, which says Goodbye to them (one line on stderr, not one per process).  A
worker that exits with an error status before it ever checked in is not restarted:
its own one-line message says what is wrong (a bad endpoint, a missing key), and
restarting would only repeat it; :class:`WorkersFailing` ends the run instead.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from engine_side.liveness import LivenessEvent, LivenessView, WorkerDead, WorkerJoined, WorkerStuck
from protocol.cli_support import EXIT_WORKERS_LOST, CliError

log = logging.getLogger("deltacast.demo")


class WorkersFailing(CliError):
    """A worker exits before joining, or the restart budget is spent."""

    def __init__(self, message: str) -> None:
        super().__init__(message, EXIT_WORKERS_LOST)


@dataclass
class Supervisor:
    """Spawns worker processes, restarts the dead, applies chaos.

    ``chaos``: kills and stalls are part of the run, so the deaths they cause are
    logged at INFO (-v) rather than as warnings.
    """

    argv: list[str]
    workers: int
    max_restarts: int = 1000
    chaos_on: bool = False
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    restarts: int = 0
    kills: int = 0
    stalls: int = 0
    events: list[dict[str, object]] = field(default_factory=list)
    closing: bool = False
    joined_pids: set[int] = field(default_factory=set)
    _stalled: dict[int, float] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    def start(self) -> None:
        for rank in range(self.workers):
            self.spawn(rank)

    def spawn(self, rank: int) -> None:
        cmd = [sys.executable, "-m", "worker_side.main", *self.argv, "--rank", str(rank)]
        self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, process_group=0)

    def tick(self, now: float, liveness: LivenessView) -> list[LivenessEvent]:
        """Resume stalled workers when due; report and restart exited ones."""
        for rank, until in list(self._stalled.items()):
            if now >= until:
                self._signal(rank, signal.SIGCONT)
                del self._stalled[rank]
        out: list[LivenessEvent] = []
        for rank, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None or self.closing:
                continue
            out += liveness.exited(rank, proc.pid, f"process exited with status {code}", now)
            self.events.append({"rank": rank, "event": "exited", "status": code})
            if code > 0 and proc.pid not in self.joined_pids:
                raise WorkersFailing(f"worker {rank} exited with status {code} before it "
                                     "joined; its message above says why")
            if self.restarts >= self.max_restarts:
                raise WorkersFailing(f"worker {rank} exited with status {code} and the "
                                     f"restart budget ({self.max_restarts}) is spent; see "
                                     "its messages above")
            self.restarts += 1
            self.spawn(rank)
        return out

    def on_event(self, event: object) -> None:
        self.events.append({"event": type(event).__name__,
                            **{k: _rounded(v) for k, v in event.__dict__.items()}})
        if isinstance(event, WorkerJoined):
            self.joined_pids.add(event.pid)
        if isinstance(event, (WorkerDead, WorkerStuck)):
            log.log(logging.INFO if self.chaos_on else logging.WARNING, "%s", event)
        if isinstance(event, WorkerStuck) and event.rank in self.procs:
            self._signal(event.rank, signal.SIGKILL)  # restarted by tick()

    def chaos(self, step: int, kill_every: int | None, stall_every: int | None,
              stall_seconds: float) -> None:
        if kill_every and step % kill_every == 0:
            rank = self._rng.randrange(self.workers)
            self._signal(rank, signal.SIGKILL)
            self.kills += 1
        if stall_every and step % stall_every == 0 and not self._stalled:
            rank = self._rng.randrange(self.workers)
            self._signal(rank, signal.SIGSTOP)
            self._stalled[rank] = time.monotonic() + stall_seconds
            self.stalls += 1

    def _signal(self, rank: int, sig: signal.Signals) -> None:
        proc = self.procs.get(rank)
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, sig)

    def resume_all(self) -> None:
        """Stop restarting and wake stalled workers (so they can hear Goodbye)."""
        self.closing = True
        for rank in list(self._stalled):
            self._signal(rank, signal.SIGCONT)
        self._stalled.clear()

    def kill_unjoined(self) -> None:
        """Kill (quietly) the workers that never checked in: no Goodbye can reach them."""
        for proc in self.procs.values():
            if proc.pid not in self.joined_pids and proc.poll() is None:
                proc.kill()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Wait for workers to leave after Goodbye; kill any straggler."""
        self.resume_all()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _rounded(value: object) -> object:
    return round(value, 3) if isinstance(value, float) else value
