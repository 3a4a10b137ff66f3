"""``DeltaExecutor``: a vLLM 0.32 ``Executor`` whose ranks get typed Delta frames.

Usage: ``LLM(model=..., distributed_executor_backend=DeltaExecutor, ...)`` or
``--distributed-executor-backend engine_side.vllm.DeltaExecutor``.

One spawned process per rank (``worker_side.vllm.proc``, started by name: vLLM's worker run
through ``WorkerWrapperBase``), each a DEALER on this executor's ROUTER over ipc:// in a
private 0700 directory (call kinds: :mod:`protocol.calls`).  ``execute_model`` /
``sample_tokens`` send the encoder's frames (encoded synchronously: the engine mutates the
SchedulerOutput after dispatch) to every rank, as one ``T`` call where vLLM samples next
with no grammar; everything else is a control call sealed with
a per-run HMAC secret (:mod:`protocol.seal`; vLLM sends functions: they travel cloudpickled
inside the seal, never as unauthenticated pickle).  Every rank answers every call, so an
exception on any rank is raised here (a step call resolves on its output rank's answer:
the others' come later, :mod:`engine_side.vllm.answers`).  A dead or frozen rank, here
or on another host, restarts the group and vLLM's scheduler recomputes every running request
(:mod:`engine_side.vllm.rank_deaths`, :mod:`engine_side.vllm.restart`; bounded:
``deltacast_restarts`` within ``deltacast_restart_window_s``); past the bound, or a
malformed answer (:class:`ExecutorFailed` names the rank) marks the executor failed,
wakes any waiting call and runs the failure callback.
A message on the ROUTER from no rank, or a malformed check-in, is dropped and counted
(``faults``).  Futures resolve in submission order.

Local step ring (``deltacast_ring_kb``, default 32 MiB, 0: off): a call goes once into
the shared-memory ring of :mod:`engine_side.ring` for every local rank, replies come
back through their reply rings; a call over ``RING_CALL_LIMIT`` (:mod:`protocol.calls`;
or half the ring), or a large reply, goes on the sockets behind an ON_PUB marker, so
replies stay in call order.
Calls are numbered and checksummed (SPEC §16): a rank that finds one missing or damaged
gets it again from the last calls kept (:mod:`engine_side.vllm.resend`); a quiet wait
pings the ranks that owe an answer; a rank that lacks a call no longer kept fails the
executor, named.  Multimodal items and prompt embeds travel as zero-copy frames, or
once through a shared-memory store (``deltacast_mm_store_mb``; ``engine_side.vllm.mm``).

Ranks on other hosts (``deltacast_nnodes`` and the rest, :mod:`engine_side.vllm.nodes`):
the engine runs node 0's ranks; each other node's reach it through that node's relay,
one CURVE connection over tcp (:mod:`engine_side.vllm.remote`), which gets each call
once; a dropped connection stops the group (a restart, or a failure naming the node).
Divergence: with TP > 1, each of the last stage's ranks checks in with a lagged hash of
its sampled tokens every ``token_hash_every`` outputs; one that differs from the output
rank's is logged, recorded (``divergent``) and called back
(``register_divergence_callback``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import cloudpickle
import zmq
from vllm.v1.executor.abstract import Executor, FailureCallback

from engine_side.ring import RingWriter
from engine_side.security import PrivateDir
from engine_side.shm_store import ShmStore
from engine_side.transport import spin_poll
from engine_side.vllm.answers import Answers, RankFault, Reply, Sampled
from engine_side.vllm.divergence import DivergenceWatch, RankDiverged
from engine_side.vllm.encoder import SchedulerOutputEncoder
from engine_side.vllm.local_ranks import LocalRanks
from engine_side.vllm.rank_deaths import ExecutorFailed, RankDeaths, liveness_bound
from engine_side.vllm.remote import RemoteRanks, layout_for
from engine_side.vllm.resend import Retransmitter
from engine_side.vllm.restart import GroupDied, RestartPolicy, SchedulerHook, renew
from engine_side.vllm.teardown import sigterm_deferred, teardown
from protocol import calls as wire
from protocol.errors import MalformedMessage, ProtocolError
from protocol.faults import PeerFaults
from protocol.ring import DEFAULT_RING_BYTES, MAX_RANKS
from protocol.seal import Opener, Sealer

log = logging.getLogger("deltacast.vllm.executor")
POLL_MS = 100  # how often a waiting call re-checks that every rank is alive
RING_POLL_MS = 1  # a blocked executor's ring check period (long steps, past the spin)
JOIN_LOG_S = 10.0  # while ranks on other nodes have not joined, say so this often


class DeltaExecutor(RankDeaths, Executor):
    """See the module docstring.  Supported: vLLM 0.32.x, TP and PP, one or more nodes."""

    supports_pp: bool = True
    token_hash_every: int = 8  # model outputs between a sampling rank's check-ins
    spin_ms: float = 1000.0  # bounded spin while steps flow (vLLM's shm readers: 1 s)

    # ------------------------------------------------------------ start-up
    def _init_executor(self) -> None:
        from vllm.utils.torch_utils import set_torch_threads_for_runtime
        from vllm.v1.executor.multiproc_executor import set_multiprocessing_worker_envs

        extra: dict[str, Any] = self.vllm_config.additional_config \
            if isinstance(self.vllm_config.additional_config, dict) else {}
        self._init_state(extra)
        self._init_channels(extra)
        set_multiprocessing_worker_envs(len(self.local_ranks))
        self._link_watch.start()
        try:
            self._start_ranks()
            self._wait_ready()
            self._attach_store()
        except BaseException:
            self.shutdown()
            raise
        if self._hook is not None:  # EngineCore builds its scheduler next
            self._hook.install()
        set_torch_threads_for_runtime()
        threading.Thread(target=self._monitor, daemon=True, name="DeltaMonitor").start()

    def _init_state(self, extra: dict[str, Any]) -> None:
        """Ranks, token-hash board, secret, store and encoder (``extra``: vLLM's
        additional_config, the deltacast_* options)."""
        self.is_failed = False
        self.failure = ""  # why, when a rank's answer failed it
        self.shutting_down = False
        self.failure_callback: FailureCallback | None = None
        self.world_size = self.parallel_config.world_size
        self.nodes = layout_for(extra, self.world_size)
        self.local_ranks = range(self.nodes.per_node(self.world_size))
        if self.nodes.remote and extra.get("deltacast_mm_store_mb"):
            raise ValueError("deltacast_mm_store_mb is a shared-memory store on the engine's "
                             "host: it cannot serve ranks on other nodes (leave it unset)")
        self.output_rank = self.world_size - self.parallel_config.tensor_parallel_size \
            * self.parallel_config.prefill_context_parallel_size
        self._all_ranks = tuple(range(self.world_size))
        samplers = range(self.output_rank, self.world_size)  # the last PP stage
        #: malformed messages: from no rank (by identity; dropped) or a rank ("rank N")
        self.faults = PeerFaults(log, "DeltaExecutor dropped a malformed message")
        self.hashes = DivergenceWatch(samplers, self.output_rank, self.faults)
        self.divergent = self.hashes.divergent  # every RankDiverged so far
        self._new_secret()
        store_mb = extra.get("deltacast_mm_store_mb", 0)
        self.spin_s = float(extra.get("deltacast_spin_ms", self.spin_ms)) / 1e3
        # ranks on other nodes: no spin by default (it takes a core from the model where
        # ranks share a host's cores: tried, dropped); a host with cores to spare may
        self.node_spin_s = float(extra.get("deltacast_node_spin_ms", 0)) / 1e3
        self.liveness_s = liveness_bound(extra)
        self._replied = 0.0  # monotonic time of the last message from a rank
        self.store = ShmStore(int(store_mb) << 20) if store_mb else None
        self.encoder = SchedulerOutputEncoder(secret=self.secret, store=self.store)
        self._pending: deque[Reply] = deque()
        self._sampled: Reply | None = None  # a `T` call's answer, for sample_tokens
        cfg = self.vllm_config  # whether vLLM samples after every step that runs the model
        self._samples = cfg.model_config.runner_type != "pooling" \
            and not cfg.is_mm_encoder_only and cfg.ec_transfer_config is None
        self.local = LocalRanks()
        self._calls = 0
        # a dead rank restarts the group (ranks on other nodes: their nodes start them again)
        self.restarts = RestartPolicy.from_config(extra)
        self._hook = SchedulerHook(self.vllm_config) if self.restarts.limit else None
        self._built: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []  # replayed
        self._serving = False  # the first step is sent: the group is built
        self._died: GroupDied | None = None  # the group is stopped, the restart due
        self._lost: tuple[int, str] | None = None  # stopped, no rank died: (rank, why)
        self._relaunching = False  # a death now fails the restart
        self._restarted = threading.Event()
        self._unsent: set[str] = set()  # requests the restarted group has not seen
        self.recoveries: list[dict[str, Any]] = []  # per restart: rank, cause, seconds
        self.loads: dict[int, float] = {}  # per rank: seconds its device and model took

    def _new_secret(self) -> None:
        """A secret for the seal (per group: a restarted group gets its own) and its seals."""
        self.secret = secrets.token_bytes(32)
        self._seal_call, self._seal_attach = (Sealer(self.secret, x) for x in (b"call", b"attach"))
        self._open_result = [Opener(self.secret, b"result:%d" % r) for r in range(self.world_size)]

    def _init_channels(self, extra: dict[str, Any]) -> None:
        """The control socket (a ROUTER on a private directory), the reply ring and the
        finalizer that closes them and reaps the ranks.  The zmq context is made here, in
        the engine process, and never crosses a fork."""
        self._dir = PrivateDir()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()  # made here, never forked
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        if not self.nodes.remote:  # a restarted rank takes its identity over at once
            self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self._init_links()
        self.remote = RemoteRanks(self.nodes, self.world_size, self._ctx, self._sock) \
            if self.nodes.remote else None
        if self.remote is not None:
            self.remote.bind(self._sock, self.vllm_config)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        # every rank needs a reply ring: beyond MAX_RANKS ranks, sockets only
        ring_kb = int(extra.get("deltacast_ring_kb", DEFAULT_RING_BYTES >> 10)) \
            if len(self.local_ranks) <= MAX_RANKS else 0
        self.ring = RingWriter(self._dir.path, ring_kb << 10, min(4 << 20, ring_kb << 10)) \
            if ring_kb else None
        self.stats: Counter[str] = Counter()  # ring_calls, socket_calls, socket_replies
        self._answers = Answers(self.world_size, self.stats)  # per rank, in call order
        self._resender = Retransmitter(self._to_rank, self.stats, self.faults)
        self._dist = [""]  # the group's torch.distributed init method (its files: cleanup)
        self._finalizer = weakref.finalize(self, teardown, self.local.procs,
                                           self.local.deaths, self._sock, self._ctx, self._dir,
                                           self.ring, self.remote, self._links,
                                           self._link_watch, self._dist)

    def _start_ranks(self) -> None:
        from vllm.utils.network_utils import get_file_store_init_method

        init_method = self.nodes.init_method if self.nodes.remote \
            else get_file_store_init_method()
        self._dist[0] = init_method
        tp = self.parallel_config.tensor_parallel_size
        endpoint = self._bind_group()
        self.local.start(self.vllm_config, self.local_ranks, lambda rank: dict(
            vllm_config=self.vllm_config, local_rank=rank, rank=rank, init_method=init_method,
            endpoint=endpoint[rank], secret=self.secret, is_driver=rank % tp == 0,
            output_rank=self.output_rank, hash_every=self._hash_every(rank), spin_s=self.spin_s,
            ring_dir=str(self._dir.path) if self.ring is not None else None,
            curve=self.remote.local_curve if self.remote else None))

    def _hash_every(self, rank: int) -> int:
        """Outputs between ``rank``'s check-ins (0: it does not check in)."""
        samplers = self.hashes.ranks
        return self.token_hash_every if rank in samplers and len(samplers) > 1 else 0

    def _wait_ready(self, within: float = 0.0) -> None:
        """Every rank ready (``within`` > 0: in that many seconds, else RuntimeError)."""
        ready: set[int] = set()
        said = started = time.monotonic()
        while len(ready) < self.world_size:
            if self.is_failed:
                raise ExecutorFailed(self.failure)
            if within and time.monotonic() - started > within:
                missing = [r for r in range(self.world_size) if r not in ready]
                raise RuntimeError(f"ranks {missing} were not ready within {within:.0f} s")
            got = self._receive(None)
            if not got and time.monotonic() - said > JOIN_LOG_S and self.remote:
                said = time.monotonic()
                missing = [r for r in range(self.world_size) if r not in ready]
                log.warning("DeltaExecutor: waiting for ranks %s (`deltacast node --node-rank "
                            "K` on node K joins at %s)", missing, self.remote.waiting_for())
            for rank, (kind, *rest) in got:
                if kind == wire.HELLO and self.remote and rank in self.remote.ranks:
                    settings = wire.WELCOME_SETTINGS.pack(self._hash_every(rank),
                                                          self.node_spin_s)
                    self.remote.welcome(self._sock, rank, rest, self.vllm_config, self.secret,
                                        settings, self.faults)
                elif kind == wire.FAILED:
                    raise RuntimeError(f"DeltaExecutor rank {rank} failed to start:\n"
                                       + b"".join(rest).decode(errors="replace"))
                elif kind != wire.READY:
                    raise RuntimeError(f"rank {rank} sent {kind!r} before ready")
                else:
                    ready.add(rank)
                    self.loads[rank] = wire.ready_seconds(rest)

    def _attach_store(self) -> None:
        """Every rank attaches a reader to the store (one sealed map rank -> AttachInfo)."""
        if self.store is None:
            return
        infos = {rank: self.store.add_reader(pid) for rank, pid in enumerate(self.local.pids())}
        self._submit(wire.ATTACH, [self._seal_attach.seal({"attach": infos})], lambda r: None,
                     timeout=60).result()

    def register_failure_callback(self, callback: FailureCallback) -> None:
        if self.is_failed:
            callback()
        else:
            self.failure_callback = callback

    # ------------------------------------------------------------ transport
    def _receive(self, call: Reply | None) -> list[tuple[int, list[bytes]]]:
        """ROUTER messages available within POLL_MS, as (rank, frames), after filing the
        reply rings' records into the inboxes; raises if a rank died or ``call`` is late."""
        if not self._arrived():
            self._check_alive()
            if call is not None and call.deadline is not None and time.monotonic() > call.deadline:
                self._overdue(call)  # (RankDeaths: the group stops to restart, or it fails)
            return []
        ring, got = self.ring, []
        while self._sock.poll(0, zmq.POLLIN):
            ident, *frames = self._recv()
            rank = wire.rank_of(ident, self.world_size)
            if rank is None or not frames:  # not from a rank (a peer in our directory?)
                self.faults.hit(ident, MalformedMessage("not a rank's message", frames=len(frames)))
            elif frames[0] == wire.CHECK_IN:
                self.hashes.hear(rank, frames[1:])
            elif frames[0] == wire.RESEND:
                self._resend(rank, frames[1:])
            else:
                got.append((rank, frames))
        if ring is not None:  # read after the ROUTER: a large reply's marker is in already
            for rank, kind, payload in ring.replies():
                if rank < self.world_size:  # (a ring of no rank: nobody's answer)
                    self._answers.ring_record(rank, kind, payload)
                else:
                    self.faults.hit(f"reply ring {rank}", MalformedMessage("no such rank"))
        self._replied = time.monotonic()
        return got

    def _recv(self) -> list[bytes]:
        if self.remote is not None:
            return self.remote.recv(self._sock)
        return self._sock.recv_multipart(copy=True)

    def _arrived(self) -> bool:
        """Wait (spinning while steps flow) until the ROUTER or a reply ring has input;
        False after POLL_MS without any.  Blocked on the ROUTER, a ring reply is seen
        within RING_POLL_MS (ranks ring no doorbell for the executor)."""
        ring = self.ring
        in_ring = ring.replies_pending if ring is not None else lambda: False
        if self._sock.poll(0, zmq.POLLIN) or in_ring():
            return True
        left = min(self.spin_s - (time.monotonic() - self._replied), POLL_MS / 1e3)
        if left > 0 and (spin_poll(self._poller, left, in_ring) or in_ring()):
            return True
        step = POLL_MS if ring is None else RING_POLL_MS
        return any(self._sock.poll(step, zmq.POLLIN) or in_ring()
                   for _ in range(POLL_MS // step))

    def _resend(self, rank: int, frames: list[bytes]) -> None:
        """``rank`` lacks calls (lost or damaged): sent again, or, no longer kept, the
        executor fails naming the rank."""
        failure = self._resender.resend(rank, frames)
        if failure is not None:
            self.failure = f"DeltaExecutor failed: {failure}"
            log.error(self.failure)
            self._fail()

    def register_divergence_callback(self, callback: Callable[[RankDiverged], None]) -> None:
        """``callback(event)`` runs (on the calling thread) for each rank found diverging."""
        self.hashes.callbacks.append(callback)

    def _submit(self, kind: bytes, frames: list[Any], convert: Callable[[list[Any]], Any],
                timeout: float | None) -> Reply:
        if self.is_failed:
            raise ExecutorFailed(self.failure or "DeltaExecutor has failed")
        try:
            self._broadcast(kind, frames)
        except zmq.ZMQError:
            with contextlib.suppress(GroupDied):  # the restart answers the call
                self._check_alive()
            if not self.local.dead():
                raise
        deadline = None if timeout is None else time.monotonic() + timeout
        needed = (self.output_rank,) if kind in wire.STEP_KINDS else self._all_ranks
        reply = Reply(self._drain, convert, deadline, needed, kind in wire.STEP_KINDS)
        self._pending.append(reply)
        return reply

    def _broadcast(self, kind: bytes, frames: list[Any]) -> None:
        """One call to every rank: once through the ring, else once per rank on the ROUTER."""
        self._calls += 1
        call = [wire.call_head(kind, self._calls, frames), *frames]
        self._resender.record(self._calls, call)  # kept for a rank that loses it
        if self.ring is not None and self.ring.publish(call, self._calls, wire.RING_CALL_LIMIT):
            self.ring.wake()  # who sleeps
            if self.remote is not None:  # no ring elsewhere: once per node, to its relay
                self.remote.broadcast(self._sock, call)
            self.stats["ring_calls"] += 1
            return
        self.stats["socket_calls"] += 1
        for rank in self.local_ranks:  # no ring, or too large: behind its marker
            self._sock.send_multipart([str(rank).encode(), *call], copy=False)
        if self.remote is not None:
            self.remote.broadcast(self._sock, call)

    def _to_rank(self, rank: int, frames: list[Any]) -> None:
        """``frames`` to ``rank``: on its endpoint here, or through its node's relay."""
        if self.remote is not None and rank in self.remote.ranks:
            self.remote.send(self._sock, rank, frames)
        else:
            self._sock.send_multipart([b"%d" % rank, *frames], copy=False)

    def _drain(self, until: Reply) -> None:
        """Resolve pending calls oldest first, up to and including ``until``."""
        while not until.done():
            call = self._pending.popleft()
            try:
                call.set_result(call.convert(self._gather(call)))
            except GroupDied as died:
                self._pending.appendleft(call)
                self._restart(died)
            except Exception as exc:
                call.set_exception(exc)

    def _gather(self, call: Reply) -> list[Any]:
        """One answer per rank (None: one not needed and not in yet); raises the first
        rank's exception after reading all."""
        try:
            while self._answers.waiting(call.needed):
                got = self._receive(call)
                if self.is_failed:
                    raise ExecutorFailed(self.failure or "DeltaExecutor has failed")
                if not got and time.monotonic() - self._replied >= POLL_MS / 1e3:  # quiet:
                    self._resender.ping(self._answers.owing())  # a rank may lack the last call
                for rank, frames in got:
                    self._answers.socket(rank, frames)
            replies = self._answers.take(call.needed)
        except RankFault as fault:
            if isinstance(fault.error, str):  # a failed step: a peer's death's, maybe
                self._death_behind([(fault.rank, fault.error)])
            raise self._rank_fault(fault.rank, fault.error) from fault
        errors = [(r, b"".join(f[1:]).decode(errors="replace")) for r, f in enumerate(replies)
                  if f is not None and f[0] == wire.ERROR]
        if errors:
            self._death_behind(errors)  # a peer's death broke the step: GroupDied
            raise RuntimeError("; ".join(f"rank {r}: {msg}" for r, msg in errors))
        return replies

    # ------------------------------------------------------------ calls
    def _output(self, replies: list[list[bytes]]) -> Any:
        frames = replies[self.output_rank]
        try:
            if frames[0] != wire.OUTPUT:
                raise MalformedMessage("the output rank's answer is not an output")
            return self.encoder.decode_reply(frames[1:])
        except ProtocolError as exc:
            raise self._rank_fault(self.output_rank, exc) from exc

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        self._serving, restored = True, None
        if self._unsent:  # resumed after a restart: new to the group
            assert self._hook is not None  # noqa: S101 - restarts need it
            scheduler_output, restored = renew(scheduler_output, self._hook.scheduler,
                                               self._unsent)
        frames = self.encoder.encode(scheduler_output, restored)  # now: it is mutated later
        # vLLM samples next with no grammar: one call does both (SPEC §16.1, `T`)
        step = self._samples and scheduler_output.total_num_scheduled_tokens > 0 \
            and not scheduler_output.has_structured_output_requests
        sent = self._submit(wire.STEP if step else wire.EXECUTE, frames, self._output,
                            self._model_timeout())
        reply: Future[Any] = sent
        if step:  # the output is sample_tokens' (vLLM's step: execute gave None)
            self._sampled, reply = sent, Sampled(sent)
        return reply if non_block else reply.result()

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        reply, self._sampled = self._sampled, None
        if reply is None:
            frames = self.encoder.encode_grammar(grammar_output)
            reply = self._submit(wire.SAMPLE, frames, self._output, self._model_timeout())
        elif grammar_output is not None:
            raise RuntimeError("DeltaExecutor: a GrammarOutput for a step that had no "
                               "structured-output request (it was sampled without one)")
        return reply if non_block else reply.result()

    @staticmethod
    def _model_timeout() -> float:
        import vllm.envs as envs

        return float(envs.VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                       non_block: bool = False) -> Any:
        """Every rank's result; a callable travels cloudpickled inside the HMAC seal."""
        if not self._serving:
            self._built.append((method, args, kwargs or {}))  # replayed on a restart
        sent = method if isinstance(method, str) else cloudpickle.dumps(method)
        blob = self._seal_call.seal({"call": (sent, args, kwargs or {})})
        reply = self._submit(wire.CONTROL, [blob], self._results, timeout)
        return reply if non_block else reply.result()

    def _results(self, replies: list[list[bytes]]) -> list[Any]:
        """Each rank's result, opened with that rank's Opener (label ``result:<rank>``)."""
        out = []
        for rank, f in enumerate(replies):
            try:
                if len(f) != 2 or f[0] != wire.CONTROL:
                    raise MalformedMessage("a control answer is one sealed result")
                out.append(self._open_result[rank].open(f[1])["result"])
            except (ProtocolError, KeyError) as exc:
                raise self._rank_fault(rank, exc) from exc
        return out

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.encoder.kv_groups = max(1, len(kv_cache_configs[0].kv_cache_groups))
        super().initialize_from_config(kv_cache_configs)

    def take_draft_token_ids(self) -> Any:
        return self.collective_rpc("take_draft_token_ids")[self.output_rank]

    def execute_dummy_batch(self) -> None:
        self.collective_rpc("execute_dummy_batch", timeout=self._model_timeout())

    def check_health(self) -> None:
        try:
            self._check_alive()
        except GroupDied as died:
            self._restart(died)
        self.collective_rpc("check_health", timeout=10)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the engine keeps in flight (PP size, or 2 with async scheduling)."""
        return int(self.vllm_config.max_concurrent_batches)

    # ------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        """Ask every rank to quit, then join; terminate and kill stragglers; remove the
        run's files (a SIGTERM meanwhile is delivered after: ``sigterm_deferred``)."""
        if getattr(self, "shutting_down", True):
            return
        self.shutting_down = True
        with sigterm_deferred():
            if any(p.is_alive() for p in self.local.procs) or self.remote is not None:
                with contextlib.suppress(zmq.ZMQError):  # a rank never connected
                    self._broadcast(wire.QUIT, [])
            self._finalizer()
            if self.store is not None:
                self.store.close()
            self.local.lock = None  # releases the named semaphore


__all__ = ["DeltaExecutor", "ExecutorFailed", "RankDiverged"]
