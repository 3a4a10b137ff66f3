"""``deltacast worker``: one reference worker process.

Loop: receive engine messages, feed them to the pure :class:`WorkerReplica`,
act on its events.  ``Applied`` → rebuild the step's request, execute it with
the :class:`ModelRunner`, return the sampled tokens (:class:`StepResult`).
``SnapshotLoaded`` → rebuild the KV cache of the live requests
(``runner.recompute``: rejoin = resync + recompute); the next applied step is
executed normally.  ``NeedSnapshot`` → ask the engine, but only once the
subscription is proven live (the first message on SUB), as the Clone pattern
requires.  Check-ins run on their own thread.  A Goodbye ends the process
unless ``--persist``; so does engine silence for ``--engine-timeout`` seconds, and
hearing nothing at all for ``--join-timeout`` seconds after starting.

Can be started by hand on another host::

    deltacast worker --connect tcp://HOST:PORT --rank 1 \\
        --server-key engine.key --secret-key worker1.key_secret
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.cli_support import (
    EXIT_ENDPOINT,
    EXIT_ENGINE_SILENT,
    EXIT_INCOMPATIBLE,
    EXIT_JOIN_TIMEOUT,
    EXIT_NO_INPUT,
    EXIT_USAGE,
    CliError,
    Parser,
    add_common_flags,
    configure_logging,
    deferred_signals,
    endpoint,
    float_in,
    guarded,
    int_in,
)
from protocol.errors import IncompatibleVersion, ProtocolError
from protocol.faults import PeerFaults
from protocol.ipc_dir import EndpointError
from protocol.messages import CheckIn, Goodbye, NewRequest, SnapshotRequest
from protocol.rebuild import decode_extension, rebuild_request
from protocol.replies import StepResult, pack_tokens
from protocol.request import RequestSpec
from worker_side import events as ev
from worker_side.replica import WorkerReplica
from worker_side.transport import CheckInThread, ClientKeys, WorkerTransport, checked_endpoints
from worker_side.waiting import DEFAULT_SPIN_MS

if TYPE_CHECKING:
    from worker_side.runner import ModelRunner

log = logging.getLogger("deltacast.worker")

_SPIN_SLICE = 0.05  # the loop's timers run at least this often while spinning
#: a worker that hears nothing from an engine for this long gives up (exit status 3)
DEFAULT_JOIN_TIMEOUT = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, type=endpoint, metavar="ENDPOINT",
                        help="the engine's endpoint: ipc://DIR (its private directory) or "
                             "tcp://HOST:PORT (PUB there, ROUTER on PORT+1)")
    parser.add_argument("--rank", type=int_in(0, 63), default=0,
                        help="this worker's rank (0..63; unique among the engine's workers)")
    parser.add_argument("--server-key", type=Path, metavar="FILE",
                        help="tcp with CURVE: the engine's public key file")
    parser.add_argument("--secret-key", type=Path, metavar="FILE",
                        help="tcp with CURVE: this worker's .key_secret file")
    parser.add_argument("--model-seed", type=int_in(0), default=0,
                        help="the tiny model's seed (the engine's --seed)")
    parser.add_argument("--num-blocks", type=int_in(1), default=4096,
                        help="KV cache blocks (the engine's --num-blocks)")
    parser.add_argument("--block-size", type=int_in(1), default=16,
                        help="tokens per KV cache block")
    parser.add_argument("--checkin-interval", type=float_in(0, exclusive=True), default=0.05,
                        help="seconds between check-ins (the engine's liveness signal)")
    parser.add_argument("--engine-timeout", type=float_in(0, exclusive=True), default=30.0,
                        help="exit (status 4) after this many seconds without hearing the "
                             "engine")
    parser.add_argument("--join-timeout", type=float_in(0), default=DEFAULT_JOIN_TIMEOUT,
                        help="exit (status 3) if nothing arrives from the engine for this "
                             "many seconds after starting (0 = wait forever)")
    parser.add_argument("--persist", action="store_true",
                        help="survive the engine's Goodbye (wait for the next engine)")
    parser.add_argument("--rcvhwm", type=int_in(0), default=1000,
                        help="SUB high-water mark in messages (0 = unlimited)")
    parser.add_argument("--rcvbuf", type=int_in(-1), default=-1,
                        help="kernel receive buffer bytes (-1 = the OS default)")
    parser.add_argument("--max-message-bytes", type=int_in(1024), default=256 << 20,
                        help="largest message accepted from the engine (bytes)")
    parser.add_argument("--spin-ms", type=float_in(0), default=DEFAULT_SPIN_MS,
                        help="after each executed step, poll without blocking (yielding the "
                             "CPU) for up to this long before blocking; 0 = always block. "
                             "Heartbeats do not extend it: an idle worker blocks")
    parser.add_argument("--ack-only", action="store_true",
                        help="benchmarks: rebuild each request and acknowledge it, no model")


def _keys(args: argparse.Namespace) -> ClientKeys | None:
    if args.server_key is None and args.secret_key is None:
        return None
    if args.server_key is None or args.secret_key is None:
        raise CliError("--server-key and --secret-key go together", EXIT_USAGE)
    for path in (args.server_key, args.secret_key):
        if not path.is_file():
            raise CliError(f"{path}: no such key file", EXIT_NO_INPUT)
    try:
        return ClientKeys.from_files(args.server_key, args.secret_key)
    except (ValueError, OSError) as exc:
        raise CliError(f"{exc} (pass the engine's .key file and this worker's .key_secret)",
                       EXIT_ENDPOINT) from exc


class Worker:
    """The worker loop (single thread, plus the check-in thread)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rank = args, args.rank
        self.runner = None if args.ack_only else _make_runner(args)
        self.replica = WorkerReplica(silence_timeout=1.0, snapshot_retry=0.5,
                                     on_event=self._on_step,
                                     check=lambda delta: decode_extension(delta.body))
        keys = _keys(args)
        identity = f"{self.rank}-{os.getpid()}".encode()
        self.transport = WorkerTransport(args.connect, keys, rcvhwm=args.rcvhwm,
                                         rcvbuf=args.rcvbuf, identity=identity,
                                         max_message_bytes=args.max_message_bytes,
                                         rank=self.rank)
        self.checkin = CheckInThread(args.connect, self.status, args.checkin_interval, keys)
        self._want_snapshot = False
        self._rejoined = False
        self._specs: dict[int, tuple[NewRequest, RequestSpec]] = {}  # rebuild_request's cache
        self._last_token_seq = -1
        self._last_step = float("-inf")  # end of the last executed step: starts the spin
        self.counts = {"executed": 0, "resyncs": 0, "recomputed": 0, "rejected": 0,
                       "bad_steps": 0}
        self.bad_steps = PeerFaults(log, f"rank {self.rank}: could not run a step")
        self.rejected = PeerFaults(log, f"rank {self.rank}: ignored a message without a "
                                   "transition")

    def status(self) -> CheckIn:
        """Called from the check-in thread: reads only atomically replaced fields."""
        r = self.replica
        token_hash = self.runner.token_hash() if self.runner is not None else 0
        return CheckIn(epoch=r.epoch, seq=r.seq, rank=self.rank, state=r.state.value,
                       token_hash=token_hash, token_hash_seq=self._last_token_seq,
                       pid=os.getpid())

    def run(self) -> int:
        self.checkin.start()
        started = time.monotonic()
        try:
            return self._loop(started)
        except IncompatibleVersion as exc:
            log.error("rank %d: the engine speaks an incompatible protocol: %s", self.rank, exc)
            return EXIT_INCOMPATIBLE
        finally:
            with deferred_signals():  # a signal now waits until the sockets are closed
                self._shutdown()

    def _loop(self, started: float) -> int:
        """Receive, feed the replica, act; returns the exit status."""
        spin = self.args.spin_ms / 1e3
        while True:
            left = min(spin - (time.monotonic() - self._last_step), _SPIN_SLICE)
            msgs = self.transport.recv(50, left)
            now = time.monotonic()
            for msg in msgs:
                if self._handle(self._receive(msg, now)):
                    return 0
            if self._handle(self.replica.poll(now)):
                return 0
            code = self._timeouts(now, started)
            if code is not None:
                return code
            self._maybe_request_snapshot()

    def _receive(self, msg: object, now: float) -> list[ev.Event]:
        try:
            return self.replica.receive(msg, now)  # type: ignore[arg-type]
        except IncompatibleVersion:
            raise  # fatal: run() reports it and exits
        except ProtocolError as exc:  # a message with no transition: state unchanged
            self.counts["rejected"] += 1  # (the first one is logged)
            self.rejected.hit("the engine", exc)
            return []

    def _on_step(self, event: ev.Event) -> None:
        """The replica loaded a snapshot or applied a delta, just now: act on that state
        (one receive may do several of each)."""
        if isinstance(event, ev.SnapshotLoaded):
            self._recompute()
        elif isinstance(event, ev.Applied):
            self._execute()
            self._last_step = time.monotonic()

    def _handle(self, events: list[ev.Event]) -> bool:
        """Act on replica events; True means exit."""
        for event in events:
            if isinstance(event, ev.NeedSnapshot):
                self._want_snapshot = True
            elif isinstance(event, (ev.GapDetected, ev.EpochChanged, ev.RejectedDelta)):
                self.counts["resyncs"] += 1
                log.info("rank %d: %s; resyncing", self.rank, event)
            elif isinstance(event, ev.Closed) and not self.args.persist:
                return True
        return False

    def _recompute(self) -> None:
        assert self.replica.data is not None
        if self.runner is None:
            return
        positions = self.runner.recompute(self.replica.data)
        self.counts["recomputed"] += positions
        self._rejoined = positions > 0  # joined with live requests: a real rejoin

    def _execute(self) -> None:
        data, last, applied = self.replica.data, self.replica.last, self.replica.applied
        assert data is not None and last is not None and applied is not None  # Applied
        try:
            req = rebuild_request(data, last.body, applied, self._specs)
        except ProtocolError as exc:  # step-only data the checks before it applied missed
            self.counts["bad_steps"] += 1
            self.bad_steps.hit("the engine", exc)
            return
        if self.runner is None:  # --ack-only: the rebuilt request is in hand; report the digest
            assert self.replica.data is not None
            digest = self.replica.data.digest.to_bytes(8, "little")
            self.transport.send(StepResult(epoch=self.replica.epoch, seq=self.replica.seq,
                                           rank=self.rank, tokens=digest))
            self.counts["executed"] += 1
            return
        out = self.runner.execute(req)
        index = {req_id: i for i, req_id in enumerate(req.req_ids)}
        rows = [index[req_id] for req_id in out.req_ids]
        self.transport.send(StepResult(epoch=self.replica.epoch, seq=self.replica.seq,
                                       rank=self.rank, rows=pack_tokens(rows),
                                       tokens=pack_tokens(out.token_ids),
                                       rejoined=self._rejoined))
        self._rejoined = False
        self._last_token_seq = self.replica.seq
        self.counts["executed"] += 1

    def _maybe_request_snapshot(self) -> None:
        if self._want_snapshot and self.transport.heard:
            self.transport.send(SnapshotRequest(epoch=self.replica.epoch, seq=self.replica.seq,
                                                rank=self.rank))
            self._want_snapshot = False

    def _timeouts(self, now: float, started: float) -> int | None:
        if not self.transport.heard and 0 < self.args.join_timeout < now - started:
            log.error("rank %d: nothing received from %s in %.1f s: wrong endpoint, engine "
                      "down, or our CURVE key is not on the engine's allow list "
                      "(--join-timeout)", self.rank, self.args.connect, self.args.join_timeout)
            return EXIT_JOIN_TIMEOUT
        heard = self.replica._last_heard
        if heard is not None and now - heard > self.args.engine_timeout:
            log.error("rank %d: engine silent for %.1f s; exiting (--engine-timeout)",
                      self.rank, now - heard)
            return EXIT_ENGINE_SILENT
        return None

    def _shutdown(self) -> None:
        self.transport.send(Goodbye(epoch=self.replica.epoch, seq=self.replica.seq,
                                    reason=f"rank {self.rank} exiting"))
        self.checkin.stop()
        stats = {"rank": self.rank, **self.counts, **self.transport.stats(),
                 **{f"replica_{k}": v for k, v in self.replica.stats.items()}}
        if getattr(self.args, "verbose", 0):  # quiet on success unless -v
            print("worker-stats " + json.dumps(stats), file=sys.stderr, flush=True)
        self.transport.close()


def _make_runner(args: argparse.Namespace) -> ModelRunner:
    import torch

    from worker_side.model import TinyModel
    from worker_side.runner import ModelRunner

    torch.set_num_threads(1)
    return ModelRunner(TinyModel(seed=args.model_seed), num_blocks=args.num_blocks,
                       block_size=args.block_size)


def run(args: argparse.Namespace) -> int:
    configure_logging(getattr(args, "verbose", 0), f"worker[{args.rank}]")
    try:
        _keys(args)  # (the keys and the endpoint are checked before the model is built)
        checked_endpoints(args.connect)
        worker = Worker(args)
    except EndpointError as exc:  # e.g. an ipc directory that is not private
        raise CliError(f"rank {args.rank}: {exc}", EXIT_ENDPOINT) from exc
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    """``python -m worker_side.main`` (how the demo starts its workers)."""
    parser = Parser(prog="deltacast worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    add_common_flags(parser)
    args = parser.parse_args(argv)
    return guarded(f"deltacast worker (rank {args.rank})", lambda: run(args),
                   debug=lambda: bool(args.debug))


if __name__ == "__main__":
    sys.exit(main())
