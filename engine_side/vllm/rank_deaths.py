"""What a dead or faulty rank does to DeltaExecutor: restart the group, or fail.

A rank on the engine's host that dies stops its whole group (the survivors are
killed: they may wait in a collective that never ends).  One that is frozen (its link
unheard for ``deltacast_liveness_s``: ZMTP heartbeats, answered by its I/O thread, so a
stopped, frozen or starved process, never a long step) is killed, and dies so.  A node
whose link drops (a rank there killed, frozen or cut off) stops the group too: its
local ranks are killed; so does a model step unanswered past vLLM's step timeout
(``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS``) while every link is heard: a rank hung in a
kernel or a collective.  Within the restart bound
(:class:`engine_side.vllm.restart.RestartPolicy`) and once serving, the engine's next
wait for an answer restarts the group (:mod:`engine_side.vllm.restart` says how; the
ranks on other nodes are told to exit and their nodes start them again) and answers
every call in flight; else, or for a malformed answer, the executor fails:
:attr:`failure` says why, waiting calls raise :class:`ExecutorFailed`, the failure
callback runs once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

import zmq

from engine_side.vllm.restart import GroupDied, recompute
from protocol import calls as wire
from protocol.errors import ProtocolError

log = logging.getLogger("deltacast.vllm.executor")
LINK_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
               | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
LINK_POLL_MS = 100  # how often the link watch looks at its stop flag
_EXITING_S = 0.1  # a rank whose link dropped and that is still alive this long is frozen
REJOIN_S = 150.0  # a restarted group's ranks on other nodes are ready within this long


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


def liveness_bound(extra: dict[str, Any]) -> float:
    """``deltacast_liveness_s`` of vLLM's additional_config (default: ``wire.LIVENESS_S``)."""
    seconds = float(extra.get("deltacast_liveness_s", wire.LIVENESS_S))
    if not 0.01 <= seconds <= 3600:
        raise ValueError("deltacast_liveness_s (seconds a rank may go unheard) must be "
                         f"within 0.01 and 3600, got {seconds}")
    return seconds


class ExecutorFailed(RuntimeError):
    """A rank died past the restart bound (or while starting) or sent a malformed
    answer: the executor is permanently failed."""


class RankDeaths:
    """What a dead or faulty rank does to DeltaExecutor (mixed into it): see the module
    docstring.  Methods take ``self: Any``: the executor's state is made in its module."""

    _died: GroupDied | None  # the group is stopped, the restart due
    _lost: tuple[int, str] | None  # the group stops, no rank died: (the rank named, why)
    failure_callback: Callable[[], None] | None

    def _monitor(self: Any) -> None:
        """Wait for a rank to exit and stop the group; with a restart allowed, the engine's
        next wait restarts it (:meth:`_restart`); else fail and call back."""
        while True:
            rank, code = self.local.wait_death()
            if self.shutting_down or self.is_failed:
                return
            self.local.kill()  # the other shards are useless without it
            lost, self._lost = self._lost, None
            died = GroupDied(rank, code, self.local.frozen.pop(rank, None)) if lost is None \
                else GroupDied(lost[0], None, cause=lost[1])
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

    def _init_links(self: Any) -> None:
        """ZMTP heartbeats on the ROUTER's links, its monitor socket and their watch."""
        interval, timeout = wire.heartbeat_ms(self.liveness_s)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
        self._links = self._sock.get_monitor_socket(LINK_EVENTS)
        self._endpoints: dict[str, int] = {}  # the local ranks' endpoints, this group's
        self._groups = 0  # groups started (a group's endpoints carry its number)
        self._link_watch = threading.Thread(target=self._watch_links, daemon=True,
                                            name="DeltaLinks")

    def _bind_group(self: Any) -> dict[int, str]:
        """Each local rank's own endpoint (rank -> endpoint), named by the group: a
        link's monitor events name its rank, and an older group's are told apart (its
        endpoints unbound)."""
        old, self._groups = list(self._endpoints), self._groups + 1
        ends = {f"{self._dir.endpoint}/ctl{self._groups}-{r}": r for r in self.local_ranks}
        for where in ends:
            self._sock.bind(where)
        self._endpoints = ends
        for where in old:
            self._sock.unbind(where)
        return {r: where for where, r in ends.items()}

    def _watch_links(self: Any) -> None:
        """Until shutdown, the ROUTER's monitor events (its own thread): a local rank's
        link dropping (:meth:`_link_dropped`), a node's (:meth:`_node_lost`)."""
        from zmq.utils.monitor import recv_monitor_message

        while not self.shutting_down:
            if not self._links.poll(LINK_POLL_MS):
                continue
            event = recv_monitor_message(self._links)
            where = event["endpoint"].decode(errors="replace")
            if where.startswith("tcp://") and self.remote is not None:
                node = self.remote.link_event(event["event"], where)
                if node is not None and not self.shutting_down:
                    self._node_lost(node)
            elif event["event"] == zmq.EVENT_DISCONNECTED and where in self._endpoints:
                self._link_dropped(self._endpoints[where])

    def _link_dropped(self: Any, rank: int) -> None:
        """Local ``rank``'s link dropped: dead (its death is the monitor's), or, still
        alive after _EXITING_S, frozen: killed, so that it dies (the endpoint names the
        group's generation: an older group's link is not this one's).  Only while the
        group serves: a group that starts (a cold machine's first imports can stall a
        whole process past the bound) is left to start, as vLLM's own executor does."""
        procs = list(self.local.procs)
        if rank >= len(procs) or self.shutting_down or self.is_failed:
            return
        proc = procs[rank]
        if wait([proc.sentinel], _EXITING_S) or self.shutting_down:
            return
        if not self._serving or self._relaunching or self._died is not None:
            log.warning("DeltaExecutor rank %d went unheard for %g s while its group "
                        "starts; not taken for frozen", rank, self.liveness_s)
            return
        log.error("DeltaExecutor rank %d is frozen (no heartbeat for %g s); killing it",
                  rank, self.liveness_s)
        self.local.frozen[rank] = self.liveness_s
        proc.kill()

    def _node_lost(self: Any, node: int) -> None:
        """Node ``node``'s link dropped: its group stops (the local ranks are killed),
        and the monitor restarts it (the node starts its ranks again) or fails.  Ignored
        while a restart is under way (the old group's links drop then)."""
        assert self.remote is not None
        if self._died is not None or self._relaunching or self.is_failed:
            return
        why = (f"{self.remote.describe(node)} dropped its connection: killed, frozen, or "
               f"cut off (no heartbeat for {self.liveness_s:g} s)")
        if self._serving and self.restarts.limit:
            self._stop_group(node * self.remote.layout.per_node(self.world_size), why)
            return
        self.failure = f"DeltaExecutor failed: {why}"
        log.error(self.failure)
        self.local.kill()  # the local shards are useless without it
        self._fail()

    def _stop_group(self: Any, rank: int, why: str) -> None:
        """Stop the group although no rank died: the local ranks are killed, and the
        monitor's cause for their deaths is ``why`` (naming ``rank``): it restarts the
        group, or fails past the bound."""
        self._lost = (rank, why)
        self.local.kill()

    def _overdue(self: Any, call: Any) -> None:
        """``call``'s answers are past its deadline while every link is heard: a rank
        hangs inside it (a deadlocked kernel or collective).  A model step once serving,
        within the restart bound: the group stops as for a lost node (the monitor
        restarts it, and the restart answers the step); else TimeoutError, the executor
        failed (a late answer would answer the wrong call)."""
        if call.step and self._serving and self.restarts.limit and not self.is_failed:
            if self._died is not None or self._lost is not None or self._relaunching:
                return  # the group is stopping already: its restart answers the step
            # (which rank hangs is not known: the others wait for it in a collective)
            why = (f"no answer to a step within {self._model_timeout():g} s "
                   "(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS): a rank hangs in a kernel or a "
                   "collective")
            log.error("DeltaExecutor: %s; stopping the group", why)
            self._stop_group(self.output_rank, why)
            return
        self.is_failed = True
        raise TimeoutError("DeltaExecutor call timed out; the executor has failed")

    def _fail(self: Any) -> None:
        """Mark the executor failed and run the failure callback (once)."""
        self.is_failed = True
        callback, self.failure_callback = self.failure_callback, None
        if callback is not None:
            callback()

    def _rank_fault(self: Any, rank: int, error: ProtocolError | KeyError | str
                    ) -> ExecutorFailed:
        """``rank`` answered with a malformed message (``error``), or failed a step call
        that had resolved (``error`` its text): its fault, and fatal (call order is lost,
        or its peers went on without it); logged, counted, the executor failed.  Raise
        the result."""
        self.faults.count(f"rank {rank}")
        what = f"failed a step its output rank had answered: {error}" \
            if isinstance(error, str) else f"sent a malformed answer: {error}"
        self.failure = f"DeltaExecutor failed: rank {rank} {what}"
        log.error("%s", self.failure)
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

    def _death_behind(self: Any, errors: list[tuple[int, str]]) -> None:
        """Ranks answered a step with ``errors``.  One whose peer died fails its next
        collective at once (gloo sees the peer's socket reset) and may answer before
        the death is noticed (a node's link within the liveness bound): wait that long
        for the group's death and raise it (GroupDied, so the restart answers the call,
        or past the restart bound ExecutorFailed naming the dead rank or node); none:
        return (the errors are the ranks' own)."""
        until = time.monotonic() + 2 * self.liveness_s + 0.5
        try:
            while self._serving and not self._relaunching and time.monotonic() < until:
                self._check_alive()  # the death: GroupDied, or ExecutorFailed
                time.sleep(0.01)
        except GroupDied:
            log.warning("DeltaExecutor: rank(s) %s failed a step as the group died: %s",
                        [r for r, _ in errors], "; ".join(m[:200] for _, m in errors))
            raise

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
        self._restart_remote()
        while self._sock.poll(0, zmq.POLLIN):  # the old group's last words
            self._sock.recv_multipart()
        if self.ring is not None:
            self.ring.reset()
        self._new_secret()
        self._answers = Answers(self.world_size, self.stats)
        self._resender = Retransmitter(self._to_rank, self.stats, self.faults)
        self.encoder = SchedulerOutputEncoder(self.encoder.kv_groups, self.secret,
                                              store=self.store)
        self.hashes.restart()
        self._calls = 0
        self.loads.clear()
        with self._hook.removed():
            self._start_ranks()
        self._wait_ready(REJOIN_S if self.remote is not None else 0.0)
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

    def _restart_remote(self: Any) -> None:
        """Tell the ranks on other nodes that their group restarts (a QUIT naming it:
        each exits, and its node starts it again); one already gone is skipped."""
        if self.remote is None:
            return
        self._calls += 1
        call = [wire.call_head(wire.QUIT, self._calls, [wire.RESTART]), wire.RESTART]
        with contextlib.suppress(zmq.ZMQError):  # (gone: ROUTER_MANDATORY refuses)
            self.remote.broadcast(self._sock, call)
