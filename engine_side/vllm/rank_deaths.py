"""What a dead or faulty rank does to DeltaExecutor: restart the group, or fail.

A rank on the engine's host that dies stops its whole group (the survivors are
killed: they may wait in a collective that never ends).  Within the restart bound
(:class:`engine_side.vllm.restart.RestartPolicy`) and once serving, the engine's next
wait for an answer restarts the group (:mod:`engine_side.vllm.restart` says how) and
answers every call in flight; else, or for a rank on another host, or a malformed
answer, the executor fails: :attr:`failure` says why, waiting calls raise
:class:`ExecutorFailed`, the failure callback runs once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from engine_side.vllm.remote import HEARTBEAT_S
from engine_side.vllm.restart import GroupDied, recompute
from protocol.errors import ProtocolError

log = logging.getLogger("deltacast.vllm.executor")


_METRICS: tuple[Any, Any] | None = None


def restart_metrics() -> tuple[Any, Any]:
    """The Prometheus counter of restarts (by the rank that died) and histogram of their
    seconds, made once per process (prometheus_client refuses a name twice).  They live
    in the engine core's process: vLLM's ``/metrics`` shows them in its multiprocess
    mode (``PROMETHEUS_MULTIPROC_DIR`` set, as vLLM does itself with
    ``--api-server-count`` > 1)."""
    global _METRICS
    if _METRICS is None:
        from prometheus_client import Counter, Histogram

        _METRICS = (Counter("deltacast_rank_restarts", "DeltaExecutor group restarts after a "
                            "rank of the group died", ["rank"]),
                    Histogram("deltacast_restart_seconds", "Seconds from a rank's death "
                              "noticed to its group restarted",
                              buckets=(1, 2, 5, 10, 15, 20, 30, 60, 120)))
    return _METRICS


class ExecutorFailed(RuntimeError):
    """A rank died past the restart bound (or on another host) or sent a malformed
    answer: the executor is permanently failed."""


class RankDeaths:
    """What a dead or faulty rank does to DeltaExecutor (mixed into it): see the module
    docstring.  Methods take ``self: Any``: the executor's state is made in its module."""

    _died: GroupDied | None  # the group is stopped, the restart due
    failure_callback: Callable[[], None] | None

    def _monitor(self: Any) -> None:
        """Wait for a rank to exit and stop the group; with a restart allowed, the engine's
        next wait restarts it (:meth:`_restart`); else fail and call back."""
        while True:
            rank, code = self.local.wait_death()
            if self.shutting_down or self.is_failed:
                return
            self.local.kill()  # the other shards are useless without it
            died = GroupDied(rank, code)
            if not self._serving or not self.restarts.allow():
                why = "starting up" if not self._serving else self.restarts.refusal()
                self.failure = f"DeltaExecutor failed: {died}; {why}"
                log.error(self.failure)
                self._fail()
                return
            log.warning("DeltaExecutor %s; restarting the group", died)
            self._restarted.clear()
            self._died = died
            self._restarted.wait()

    def _watch_links(self: Any) -> None:
        if self.remote is not None:
            self.remote.watch(lambda: self.shutting_down, self._node_lost)

    def _node_lost(self: Any, node: int) -> None:
        assert self.remote is not None
        self.failure = (f"DeltaExecutor failed: {self.remote.describe(node)} dropped its "
                        f"connection: killed, frozen, or cut off (no heartbeat for "
                        f"{HEARTBEAT_S} s)")
        log.error(self.failure)
        self.local.kill()  # the local shards are useless without it
        self._fail()

    def _fail(self: Any) -> None:
        """Mark the executor failed and run the failure callback (once)."""
        self.is_failed = True
        callback, self.failure_callback = self.failure_callback, None
        if callback is not None:
            callback()

    def _rank_fault(self: Any, rank: int, error: ProtocolError | KeyError) -> ExecutorFailed:
        """``rank`` answered with a malformed message (``error``): its fault, and fatal
        (call order is lost); logged, counted, the executor failed.  Raise the result."""
        self.faults.count(f"rank {rank}")
        log.error("DeltaExecutor rank %d sent a malformed answer (%s); the executor has "
                  "failed", rank, error)
        self.failure = f"DeltaExecutor failed: rank {rank} sent a malformed answer: {error}"
        self._fail()
        return ExecutorFailed(self.failure)

    def _check_alive(self: Any) -> None:
        restarting = self._serving and self.restarts.limit and not self._relaunching \
            and not self.is_failed
        if restarting and self._died is not None:
            raise self._died
        dead = self.local.dead()
        if dead and restarting:
            return  # the monitor is stopping the group (a restart or a failure)
        if self.is_failed or dead:
            self.is_failed = True
            raise ExecutorFailed(self.failure or f"DeltaExecutor failed: rank(s) {dead} died")

    def _restart(self: Any, died: GroupDied) -> None:
        """Restart the stopped group, have the scheduler recompute, and answer every
        call in flight: model calls with empty outputs (the scheduler drops them: their
        requests were preempted), control calls with an error."""
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        pending = list(self._pending)
        self._pending.clear()
        took = {"noticed": died.at, "restart": time.monotonic()}
        self._relaunching = True
        try:
            preempted = self._relaunch(took)
        except BaseException as exc:
            self.failure = f"DeltaExecutor failed: {died}, and restarting the group failed: {exc}"
            log.error(self.failure)
            self._fail()
            for call in pending:
                call.set_exception(ExecutorFailed(self.failure))
            self._restarted.set()
            return
        finally:
            self._relaunching = False
        for call in pending:
            if call.convert == self._output:
                call.set_result(EMPTY_MODEL_RUNNER_OUTPUT)
            else:
                call.set_exception(RuntimeError(f"DeltaExecutor: {died} before this call was "
                                                "answered; the group restarted"))
        self._died = None
        self._restarted.set()
        seconds = {k: round(took[b] - took[a], 3) for k, a, b in (
            ("stop", "noticed", "stopped"), ("start", "stopped", "started"),
            ("build", "started", "built"), ("total", "noticed", "built"))}
        seconds["load"] = round(min(max(self.loads.values(), default=0.0), seconds["start"]), 3)
        seconds["spawn"] = round(seconds["start"] - seconds["load"], 3)
        self.recoveries.append({"rank": died.rank, "cause": str(died), "preempted": preempted,
                                "noticed_at": died.at, **seconds})
        counter, histogram = restart_metrics()
        counter.labels(rank=str(died.rank)).inc()
        histogram.observe(seconds["total"])
        log.warning("DeltaExecutor restarted the group after %s in %.1f s (restart %d: stop "
                    "%.1f s, processes %.1f s, device and weights %.1f s, KV and warm-up "
                    "%.1f s); %d running request(s) recompute", died, seconds["total"],
                    self.restarts.count, seconds["stop"], seconds["spawn"], seconds["load"],
                    seconds["build"], preempted)

    def _relaunch(self: Any, took: dict[str, float]) -> int:
        """Reap the old group, reset what was paired with it, start and build a new one;
        then preempt the running requests.  The number preempted; ``took`` gets when
        each phase ended (monotonic)."""
        from engine_side.spawn import reap
        from engine_side.vllm.answers import Answers
        from engine_side.vllm.encoder import SchedulerOutputEncoder
        from engine_side.vllm.local_ranks import remove_dist_files
        from engine_side.vllm.resend import Retransmitter

        assert self._hook is not None and self._hook.scheduler is not None  # noqa: S101
        reap(self.local.procs, self.local.deaths, 5.0)  # (killed: at once)
        remove_dist_files(self._dist[0])
        self.local.procs.clear()
        self.local.deaths.clear()
        took["stopped"] = time.monotonic()
        while self._sock.poll(0, zmq.POLLIN):  # the old group's last words
            self._sock.recv_multipart()
        if self.ring is not None:
            self.ring.reset()
        self._new_secret()
        self._answers = Answers(self.world_size, self.stats)
        self._resender = Retransmitter(self._sock, self.stats, self.faults)
        self.encoder = SchedulerOutputEncoder(self.encoder.kv_groups, self.secret,
                                              store=self.store)
        self.hashes.restart()
        self._calls = 0
        self.loads.clear()
        with self._hook.removed():
            self._start_ranks()
        self._wait_ready()
        took["started"] = time.monotonic()
        if self.store is not None:
            self.store.reap()
            self._attach_store()
        for method, args, kwargs in self._built:
            self.collective_rpc(method, args=args, kwargs=kwargs)
        scheduler = self._hook.scheduler
        self._unsent = set(scheduler.requests)
        took["built"] = time.monotonic()
        return recompute(scheduler)
