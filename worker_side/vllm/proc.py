"""One DeltaExecutor rank: a spawned process running vLLM's worker through ``WorkerWrapperBase``.

Wire (a DEALER whose identity is the rank, connected to the executor's ROUTER
over ipc:// in a private directory; the kinds: :mod:`protocol.calls`).  Engine → rank:
``[head, *frames]``, the head naming the kind, the call's number and its CRC (a call
lost or damaged is asked for again: :mod:`worker_side.vllm.channel`):

* ``X`` execute_model: the encoder's Delta frames (every rank decodes them);
* ``S`` sample_tokens: the encoder's GrammarOutput frames;
* ``C`` control: one HMAC-sealed ``(method, args, kwargs)`` (method a name or
  cloudpickled callable bytes, verified before anything is unpickled; seal label
  ``b"call"``, :mod:`protocol.seal`);
* ``A`` attach: a sealed (``b"attach"``) map rank -> store ``AttachInfo``; the rank's
  decoder then resolves multimodal items from the engine's shared-memory store;
* ``Q`` quit; with the one frame ``restart`` (a rank on another node: its group restarts)
  the rank exits with status RESTART_EXIT, and its node starts it again.

With the executor's local step ring (its default), the same calls arrive once
through the ring and replies leave through the rank's reply ring
(:mod:`worker_side.vllm.channel`); ready, failed and check-ins stay on the DEALER.  A
rank on another node reads its calls from its relay's ring and replies on the DEALER.

Rank → engine: ``R`` ready, ``F`` failed to start (text), ``O`` reply frames
(output rank), ``K`` done (other ranks: to step calls held back, up to DONE_MAX in one,
until their next other answer), ``C`` sealed control result (label
``b"result:<rank>"``), ``E`` an exception (text).  Every rank answers every call, so
an exception on ANY rank reaches the engine.  Unsolicited: ``H`` check-in,
``(outputs folded, token hash)`` (:mod:`worker_side.vllm.tokenhash`), sent by a
sampling rank every ``hash_every`` model outputs right after that output's reply.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from protocol.calls import (
    ATTACH,
    CHECK_IN,
    CONTROL,
    DONE,
    ERROR,
    EXECUTE,
    FAILED,
    HELLO,
    LIVENESS_S,
    OUTPUT,
    QUIT,
    READY,
    REFUSED,
    RESTART,
    RESTART_EXIT,
    SAMPLE,
    STEP,
    STEP_KINDS,
    WELCOME,
    WELCOME_SETTINGS,
    heartbeat_ms,
    pack_hello,
)
from protocol.errors import MalformedMessage
from protocol.messages import PROTOCOL_MAJOR
from protocol.seal import Opener, Sealer
from worker_side.vllm.channel import RankChannel
from worker_side.vllm.decoder import SchedulerOutputDecoder
from worker_side.vllm.resume import resume
from worker_side.vllm.tokenhash import TokenHash


def _watch_parent(death: Connection) -> None:
    """Exit when the executor's end of the pipe closes (its process died): no orphans."""
    def watch() -> None:
        with contextlib.suppress(EOFError, OSError):
            death.recv()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="DeltaDeathPipe").start()


HEARTBEAT_S = LIVENESS_S  # our node's relay unheard this long is gone
_SAY_S = 10.0  # while the engine has not answered our hello, say so this often
_quitting = threading.Event()


def _watch_engine(sock: zmq.Socket[bytes], endpoint: str, rank: int) -> threading.Thread:
    """A rank on another node: exit (status 1, one line) when its link to the node's
    relay drops after its handshake (the relay lost the engine and says why, or the
    node is gone or frozen).  The watch (returned) ends within 0.1 s of ``_quitting``;
    join it before the context's term, which would otherwise interrupt its poll and wait
    for its socket forever."""

    interval, timeout = heartbeat_ms(HEARTBEAT_S)
    sock.setsockopt(zmq.HEARTBEAT_IVL, interval)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout)
    monitor = sock.get_monitor_socket()

    def watch() -> None:
        try:
            _watch(monitor, endpoint, rank)
        finally:
            monitor.close(linger=0)  # (the context's term waits for it)

    thread = threading.Thread(target=watch, daemon=True, name="DeltaEngineWatch")
    thread.start()
    return thread


def _watch(monitor: zmq.Socket[bytes], endpoint: str, rank: int) -> None:
    from zmq.utils.monitor import recv_monitor_message

    joined = False
    with contextlib.suppress(zmq.ContextTerminated):
        while not _quitting.is_set():
            if not monitor.poll(100):
                continue
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                joined = True
            elif event == zmq.EVENT_DISCONNECTED and joined and not _quitting.is_set():
                _die(rank, f"lost the engine (its node's relay at {endpoint} closed, or "
                           f"was unheard for {HEARTBEAT_S} s)")


_node_link: list[zmq.Socket[bytes]] = []  # held until the process exits


def _link_to_node(watch: str, rank: int) -> None:
    """Connect to our node's liveness endpoint (:mod:`worker_side.vllm.rank_watch`: its
    heartbeats on this link) from a context of its own that is never closed: the link
    drops only when this process is gone (or frozen), never while it exits.  Ready, the
    rank says so on it (:func:`_ready_to_node`): from then on the node watches it."""
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, str(rank).encode())
    sock.connect(watch)
    _node_link.append(sock)


def _ready_to_node() -> None:
    for sock in _node_link:
        sock.send(b"ready")


def _die(rank: int, why: str) -> None:
    print(f"deltacast rank {rank}: {why}; exiting", file=sys.stderr, flush=True)
    os._exit(1)


def _join(sock: zmq.Socket[bytes], node: int, vllm_config: Any, endpoint: str,
          rank: int, rejoin_s: float = 0.0) -> tuple[bytes, int, float]:
    """A rank on another node says hello; the engine's welcome carries the secret of
    the sealed calls (over CURVE only) and (hash_every, spin_s).  Refused: one line on
    stderr, exit 1.  ``rejoin_s`` > 0 (started again after a restart): no welcome
    within that long (the engine gone, or failed) is an exit 1 too."""
    import vllm

    sock.send_multipart([HELLO, pack_hello(
        node=str(node), vllm=vllm.__version__, protocol=str(PROTOCOL_MAJOR),
        config=vllm_config.compute_hash())])
    waited = 0.0
    while True:
        if not sock.poll(int(_SAY_S * 1000)):
            waited += _SAY_S
            if rejoin_s and waited >= rejoin_s:
                _die(rank, f"started again after its group's restart, but the engine did "
                           f"not welcome it within {rejoin_s:.0f} s")
            print(f"deltacast rank {rank}: waiting for the engine (through {endpoint})",
                  file=sys.stderr, flush=True)
            continue
        kind, *rest = sock.recv_multipart()
        if kind == WELCOME and len(rest) == 2 and len(rest[0]) == 32 \
                and len(rest[1]) == WELCOME_SETTINGS.size:
            every, spin = WELCOME_SETTINGS.unpack(rest[1])
            return rest[0], int(every), float(spin)
        if kind == REFUSED:
            _die(rank, "the engine refused this node: " + b"".join(rest).decode(errors="replace"))


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _start_worker(vllm_config: Any, local_rank: int, rank: int, init_method: str,
                  is_driver: bool, lock: Any) -> Any:
    from vllm.envs import enable_envs_cache
    from vllm.platforms import current_platform
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    wrapper = WorkerWrapperBase(rpc_rank=local_rank, global_rank=rank)
    all_kwargs: list[dict[str, Any]] = [{} for _ in range(vllm_config.parallel_config.world_size)]
    all_kwargs[local_rank] = {
        "vllm_config": vllm_config, "local_rank": local_rank, "rank": rank,
        "distributed_init_method": init_method, "is_driver_worker": is_driver,
        "shared_worker_lock": lock}
    wrapper.init_worker(all_kwargs)
    wrapper.init_device()  # collective: every rank must already be started
    _unlink_group_rings()
    wrapper.load_model()
    current_platform.update_block_size_for_backend(vllm_config)
    enable_envs_cache()
    return wrapper


def _unlink_group_rings() -> None:
    """Unlink the names of the shared-memory rings this rank made for vLLM's groups (the
    TP group's broadcast queue, ~24 MB): once the groups are up every local reader has
    mapped its ring, and the memory goes with the last process that maps it.  So a
    group killed in a restart leaves no ``/dev/shm/psm_*`` behind (the names would stay
    until the engine's resource tracker exits: /dev/shm filling up restart after
    restart).  ``unlink`` also tells the resource tracker to forget the name."""
    from vllm.distributed import parallel_state

    groups = getattr(parallel_state, "_groups", {})  # every GroupCoordinator made (weak)
    for ref in list(groups.values()):
        ring = getattr(getattr(ref(), "mq_broadcaster", None), "buffer", None)
        if ring is not None and getattr(ring, "is_creator", False):
            with contextlib.suppress(OSError):  # (a name already gone: nothing to do)
                ring.shared_memory.unlink()
            ring.is_creator = False  # (its __del__ would unlink the name again)


def worker_main(vllm_config: Any, local_rank: int, rank: int, init_method: str,
                endpoint: str, secret: bytes, is_driver: bool, output_rank: int,
                lock: Any, death: Connection, hash_every: int = 0, spin_s: float = 0.0,
                ring_dir: str | None = None, curve: tuple[bytes, bytes, bytes] | None = None,
                node: int = 0, rejoin_s: float = 0.0, watch: str | None = None) -> None:
    """Process entry point (spawned): start the worker, then serve calls until ``Q``.
    ``curve``: (the engine's public key, ours, our secret) when the engine takes ranks
    from other nodes; ``node`` > 0: this rank runs on node ``node`` and learns ``secret``
    from the engine's welcome; ``rejoin_s`` > 0: started again after a restart
    (:func:`_join`); ``watch``: our node's liveness endpoint
    (:mod:`worker_side.vllm.rank_watch`), connected for its heartbeats only."""
    from vllm.utils.system_utils import set_process_title

    set_process_title(name=f"DeltaWorker_{rank}")  # "VLLM::DeltaWorker_<rank>" in ps
    signal.signal(signal.SIGTERM, _exit_on_signal)
    _watch_parent(death)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, str(rank).encode())
    sock.setsockopt(zmq.LINGER, 1000)
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    engine_watch = _watch_engine(sock, endpoint, rank) if node else None
    sock.connect(endpoint)
    if watch is not None:
        _link_to_node(watch, rank)
    if node:
        secret, hash_every, spin_s = _join(sock, node, vllm_config, endpoint, rank, rejoin_s)
    wrapper, status = None, 0
    try:
        try:
            loading = time.monotonic()
            wrapper = _start_worker(vllm_config, local_rank, rank, init_method, is_driver, lock)
            loaded = time.monotonic() - loading
        except Exception:
            sock.send_multipart([FAILED, traceback.format_exc().encode()])
            return
        # attached before READY: sees every call (a node's ring: replies on the DEALER)
        channel = RankChannel(sock, ring_dir, rank, ring_replies=not node)
        channel.spin_s = spin_s
        sock.send_multipart([READY, b"%.3f" % loaded])
        _ready_to_node()
        server = _Server(wrapper, channel, secret, rank == output_rank, rank, hash_every)
        server.serve()
        status = RESTART_EXIT if server.restart else 0
    finally:
        _quitting.set()
        if wrapper is not None and not status:  # (a restart: the group's peers are gone)
            _shutdown_worker(wrapper)
        if engine_watch is not None:
            engine_watch.join(2.0)
        sock.close()
        ctx.term()
    _leave(status)


def _leave(status: int = 0) -> None:
    """Exit without the interpreter's teardown of torch and vLLM (2.5-5 s here: past
    vLLM's 5 s engine shutdown budget, so the engine was force-killed); the exit
    handlers (vLLM's, multiprocessing's) still run, and the streams are flushed."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _shutdown_worker(wrapper: Any) -> None:
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    try:
        wrapper.shutdown()
        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # best effort on the way out
        traceback.print_exc()


class _Server:
    """The rank's call loop; one reply per call, exceptions become ``E`` replies.

    ``hash_every`` > 0: fold each model output's sampled tokens into
    ``token_hash`` after replying, and check in every ``hash_every`` outputs.
    """

    def __init__(self, wrapper: Any, channel: RankChannel, secret: bytes,
                 is_output: bool, rank: int = 0, hash_every: int = 0) -> None:
        self.wrapper = wrapper
        self.rank = rank
        self.channel = channel
        self.secret = secret
        self.is_output = is_output
        self.decoder = SchedulerOutputDecoder(secret=secret)
        self.calls, self.attach = Opener(secret, b"call"), Opener(secret, b"attach")
        self.results = Sealer(secret, b"result:%d" % rank)
        self.hash_every = hash_every
        self.token_hash = TokenHash()
        self.sampled: Any = None  # the last call's ModelRunnerOutput, hashed after replying
        self.restart = False  # the engine's QUIT said its group restarts

    def serve(self) -> None:
        """Answer calls until ``Q`` (the channel spins while steps flow, then sleeps)."""
        while True:
            kind, frames = self.channel.next_call()  # in call order, each intact
            if kind == QUIT:
                self.restart = [bytes(f) for f in frames] == [RESTART]
                return
            try:
                reply = self._handle(kind, frames)
            except Exception as exc:
                traceback.print_exc()
                reply = [ERROR, f"{type(exc).__name__}: {exc}".encode()]
            self.channel.reply(reply, may_wait=reply == [DONE] and kind in STEP_KINDS)
            self._fold()

    def _fold(self) -> None:
        """Off the hot path (the reply has gone): hash the output, check in when due."""
        out, self.sampled = self.sampled, None
        if out is None or not self.hash_every:
            return
        self.token_hash.update(out.req_ids, out.sampled_token_ids)
        if self.token_hash.steps % self.hash_every == 0:
            self.channel.send([CHECK_IN, self.token_hash.check_in()])

    def _handle(self, kind: bytes, frames: list[bytes]) -> list[bytes]:
        if kind in (EXECUTE, STEP):
            so = self.decoder.decode(frames)
            if self.decoder.restored:  # after the engine restarted this group
                resume(self.wrapper.worker.model_runner, so, self.decoder.restored)
            out = self.wrapper.execute_model(so)
            if kind == STEP and out is None:  # and sample at once, with no GrammarOutput
                out = self.wrapper.sample_tokens(None)
            return self._output(out)
        if kind == SAMPLE:
            grammar = self.decoder.decode_grammar(frames)
            return self._output(self.wrapper.sample_tokens(grammar))
        if kind == CONTROL:
            from vllm.v1.serial_utils import run_method

            method, args, kwargs = _sealed(self.calls, frames, "call")
            result = run_method(self.wrapper, method, args, kwargs)
            return [CONTROL, self.results.seal({"result": result})]
        if kind == ATTACH:
            from worker_side.shm_reader import ShmReader

            info = _sealed(self.attach, frames, "attach")[self.rank]
            self.decoder.attach_store(ShmReader.attach(info))
            return [DONE]
        raise ValueError(f"unknown call kind {kind!r}")

    def _output(self, out: Any) -> list[bytes]:
        from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput

        if isinstance(out, AsyncModelRunnerOutput):
            out = out.get_output()
        self.sampled = out if isinstance(out, ModelRunnerOutput) else None
        if not self.is_output:
            return [DONE]
        return [OUTPUT, *(bytes(f) for f in self.decoder.encode_reply(out))]


def _sealed(opener: Opener, frames: list[bytes], key: str) -> Any:
    """``key``'s value in the one sealed frame of a call (BadSeal, MalformedMessage)."""
    if len(frames) != 1:
        raise MalformedMessage("a sealed call is one frame", frames=len(frames))
    objects = opener.open(frames[0])
    if key not in objects:
        raise MalformedMessage("a sealed call without its value", key=key)
    return objects[key]
