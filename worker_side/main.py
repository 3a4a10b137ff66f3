"""``deltacast worker``: one reference worker process.

Loop: receive engine messages, feed them to the pure :class:`WorkerReplica`,
act on its events.  ``Applied`` → rebuild the step's request, execute it with
the :class:`ModelRunner`, return the sampled tokens (:class:`StepResult`).
``SnapshotLoaded`` → rebuild the KV cache of the live requests
(``runner.recompute``: rejoin = resync + recompute); the next applied step is
executed normally.  ``NeedSnapshot`` → ask the engine, but only once the
subscription is proven live (the first message on SUB), as the Clone pattern
requires.  Check-ins run on their own thread.  A Goodbye ends the process
unless ``--persist``; so does engine silence for ``--engine-timeout`` seconds.

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

from protocol.errors import IncompatibleVersion, ProtocolError
from protocol.faults import PeerFaults
from protocol.messages import CheckIn, Goodbye, SnapshotRequest
from protocol.replies import StepResult, pack_tokens
from worker_side import events as ev
from worker_side.ipc_dir import EndpointError
from worker_side.replica import State, WorkerReplica
from worker_side.transport import CheckInThread, ClientKeys, WorkerTransport
from worker_side.waiting import DEFAULT_SPIN_MS

if TYPE_CHECKING:
    from worker_side.runner import ModelRunner

log = logging.getLogger("deltacast.worker")

_SPIN_SLICE = 0.05  # the loop's timers run at least this often while spinning


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect", required=True, help="engine endpoint: ipc://DIR or "
                        "tcp://HOST:PORT (PUB there, ROUTER on PORT+1)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--server-key", type=Path, help="engine public key file (CURVE)")
    parser.add_argument("--secret-key", type=Path, help="this worker's .key_secret file")
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--checkin-interval", type=float, default=0.05)
    parser.add_argument("--engine-timeout", type=float, default=30.0,
                        help="exit after this long without hearing the engine")
    parser.add_argument("--join-timeout", type=float, default=0.0,
                        help="exit with status 3 if nothing arrives this long (0 = wait)")
    parser.add_argument("--persist", action="store_true", help="survive the engine's Goodbye")
    parser.add_argument("--rcvhwm", type=int, default=1000)
    parser.add_argument("--rcvbuf", type=int, default=-1)
    parser.add_argument("--max-message-bytes", type=int, default=256 << 20)
    parser.add_argument("--spin-ms", type=float, default=DEFAULT_SPIN_MS,
                        help="after each executed step, poll without blocking (yielding the "
                             "CPU) for up to this long before blocking; 0 = always block. "
                             "Heartbeats do not extend it: an idle worker blocks")
    parser.add_argument("--ack-only", action="store_true",
                        help="benchmarks: rebuild each request and acknowledge it, no model")


def _keys(args: argparse.Namespace) -> ClientKeys | None:
    if args.server_key is None and args.secret_key is None:
        return None
    if args.server_key is None or args.secret_key is None:
        raise SystemExit("--server-key and --secret-key go together")
    try:
        return ClientKeys.from_files(args.server_key, args.secret_key)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc


class Worker:
    """The worker loop (single thread, plus the check-in thread)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.rank = args, args.rank
        self.runner = None if args.ack_only else _make_runner(args)
        self.replica = WorkerReplica(silence_timeout=1.0, snapshot_retry=0.5)
        keys = _keys(args)
        identity = f"{self.rank}-{os.getpid()}".encode()
        self.transport = WorkerTransport(args.connect, keys, rcvhwm=args.rcvhwm,
                                         rcvbuf=args.rcvbuf, identity=identity,
                                         max_message_bytes=args.max_message_bytes,
                                         rank=self.rank)
        self.checkin = CheckInThread(args.connect, self.status, args.checkin_interval, keys)
        self._want_snapshot = False
        self._rejoined = False
        self._last_token_seq = -1
        self._last_step = float("-inf")  # end of the last executed step: starts the spin
        self.counts = {"executed": 0, "resyncs": 0, "recomputed": 0, "rejected": 0}
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
            return 5
        finally:
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

    def _handle(self, events: list[ev.Event]) -> bool:
        """Act on replica events; True means exit."""
        applied = False
        for event in events:
            if isinstance(event, ev.SnapshotLoaded):
                self._recompute()
            elif isinstance(event, ev.Applied):
                applied = True
            elif isinstance(event, ev.NeedSnapshot):
                self._want_snapshot = True
            elif isinstance(event, (ev.GapDetected, ev.EpochChanged, ev.RejectedDelta)):
                self.counts["resyncs"] += 1
                log.info("rank %d: %s; resyncing", self.rank, event)
            elif isinstance(event, ev.Closed) and not self.args.persist:
                return True
        if applied and self.replica.state is State.SYNCED:
            self._execute()
            self._last_step = time.monotonic()
        return False

    def _recompute(self) -> None:
        assert self.replica.data is not None
        if self.runner is None:
            return
        positions = self.runner.recompute(self.replica.data)
        self.counts["recomputed"] += positions
        self._rejoined = positions > 0  # joined with live requests: a real rejoin

    def _execute(self) -> None:
        req = self.replica.request()
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
                      "down, or our CURVE key is not on the engine's allow list",
                      self.rank, self.args.connect, self.args.join_timeout)
            return 3
        heard = self.replica._last_heard
        if heard is not None and now - heard > self.args.engine_timeout:
            log.error("rank %d: engine silent for %.1f s; exiting", self.rank, now - heard)
            return 4
        return None

    def _shutdown(self) -> None:
        self.transport.send(Goodbye(epoch=self.replica.epoch, seq=self.replica.seq,
                                    reason=f"rank {self.rank} exiting"))
        self.checkin.stop()
        stats = {"rank": self.rank, **self.counts, **self.transport.stats(),
                 **{f"replica_{k}": v for k, v in self.replica.stats.items()}}
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
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s worker[{args.rank}] %(levelname)s %(message)s")
    try:
        worker = Worker(args)
    except EndpointError as exc:  # e.g. an ipc directory that is not private
        log.error("rank %d: %s", args.rank, exc)
        return 2
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="deltacast worker", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
