"""``deltacast demo``: an engine and N worker processes on a synthetic workload.

The engine runs a continuous-batching :class:`Scheduler` in engine-token mode
and steps its workers through an :class:`EngineSession`: each step's delta goes
out on PUB, every worker rebuilds the request, runs it on the tiny model and
returns its sampled tokens; the engine uses the lowest rank's tokens and checks
every other rank's against them.  A supervisor restarts workers that die (or get
stuck); they rejoin through a snapshot plus a KV recompute.  Chaos options kill
(-9) or stall (SIGSTOP/SIGCONT) random workers.  ``--reference`` re-runs the
workload in-process and requires identical outputs.  Exit status 0 means every
request completed, all ranks agreed and (with ``--reference``) outputs matched.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine_side.liveness import LivenessEvent, LivenessView, WorkerDead, WorkerStuck
from engine_side.mirror import EngineMirror
from engine_side.scheduler import Scheduler
from engine_side.session import DEFAULT_ACK_SPIN, EngineSession
from protocol.messages import TOKEN_MODE_ENGINE
from protocol.params import SamplingSpec
from protocol.request import IntArray
from worker_side.ring import DEFAULT_RING_BYTES
from worker_side.waiting import DEFAULT_SPIN_MS

if TYPE_CHECKING:  # zmq is imported only when a run starts
    from engine_side.security import CurveKeys
    from engine_side.transport import EngineTransport

log = logging.getLogger("deltacast.demo")
VOCAB = 512  # TinyModel's default vocabulary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks (16 tokens each)")
    parser.add_argument("--token-budget", type=int, default=128)
    parser.add_argument("--kill-every", type=int, default=0, metavar="K",
                        help="chaos: kill -9 a random worker every K steps")
    parser.add_argument("--stall", type=int, default=0, metavar="K",
                        help="chaos: SIGSTOP a random worker every K steps (see --stall-seconds)")
    parser.add_argument("--stall-seconds", type=float, default=1.5)
    parser.add_argument("--endpoint", default=None,
                        help="ipc://DIR (default: a fresh private dir) or tcp://HOST:PORT")
    parser.add_argument("--curve", action="store_true", help="tcp: CURVE with generated keys")
    parser.add_argument("--insecure", action="store_true", help="tcp without CURVE (warns)")
    parser.add_argument("--server-secret-key", type=Path,
                        help="tcp: the engine's .key_secret file (instead of --curve)")
    parser.add_argument("--allow-key", type=Path, action="append", default=[],
                        help="a worker public key file to admit (repeatable)")
    parser.add_argument("--worker-secret-key", type=Path,
                        help="with --server-secret-key: key file for locally spawned workers")
    parser.add_argument("--remote-workers", type=int, default=0,
                        help="also wait for this many hand-started workers (ranks after local)")
    parser.add_argument("--liveness", type=float, default=1.0, help="dead after (seconds)")
    parser.add_argument("--stuck-after", type=float, default=10.0)
    parser.add_argument("--hwm", type=int, default=1000, help="PUB/SUB high-water mark")
    parser.add_argument("--sockbuf", type=int, default=-1, help="kernel socket buffers (bytes)")
    parser.add_argument("--ring-kb", type=int, default=DEFAULT_RING_BYTES >> 10,
                        help="ipc: the local step ring's size in KiB (a worker stalled past "
                             "it resyncs; 0 = sockets only)")
    parser.add_argument("--spin-ms", type=float, default=DEFAULT_SPIN_MS,
                        help="workers' bounded spin after each step (0 = block)")
    parser.add_argument("--ack-spin-ms", type=float, default=DEFAULT_ACK_SPIN * 1e3,
                        help="engine's bounded spin while waiting for a step (0 = block)")
    parser.add_argument("--reference", action="store_true",
                        help="also run in-process and require identical outputs")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true")


# -- workload and reference --------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    req_id: str
    arrival: int  # step at which it is added
    prompt: IntArray
    max_tokens: int
    sampling: SamplingSpec | None


def make_jobs(seed: int, count: int, max_tokens: int) -> list[Job]:
    """Seeded requests: prompts of 4..80 tokens, half greedy, half seeded top-k sampling."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(count):
        sampling = None if i % 2 == 0 else SamplingSpec(temperature=0.8, top_k=40, seed=i)
        jobs.append(Job(f"req-{i}", int(rng.integers(0, 2 * count)),
                        rng.integers(0, VOCAB, int(rng.integers(4, 81))).astype(np.int64),
                        int(rng.integers(1, max_tokens + 1)), sampling))
    return sorted(jobs, key=lambda j: (j.arrival, j.req_id))


def make_scheduler(args: argparse.Namespace) -> Scheduler:
    return Scheduler(num_blocks=args.num_blocks, block_size=16, token_budget=args.token_budget,
                     max_running=min(32, args.token_budget))


def admit(scheduler: Scheduler, jobs: list[Job], step: int) -> None:
    """Add the jobs that arrive by ``step`` (consumes them); idle gaps are skipped."""
    while jobs and (jobs[0].arrival <= step or not scheduler.has_work()):
        job = jobs.pop(0)
        scheduler.add(job.req_id, job.prompt, job.max_tokens, job.sampling)


def reference_outputs(args: argparse.Namespace) -> dict[str, list[int]]:
    """The same workload through the same scheduler and runner, in this process."""
    import torch

    from worker_side.model import TinyModel
    from worker_side.runner import ModelRunner

    torch.set_num_threads(1)
    runner = ModelRunner(TinyModel(seed=args.seed), num_blocks=args.num_blocks, block_size=16)
    scheduler, jobs, step = make_scheduler(args), make_jobs(args.seed, args.requests,
                                                            args.max_tokens), 0
    while jobs or scheduler.has_work():
        admit(scheduler, jobs, step)
        out = runner.execute(scheduler.schedule())
        scheduler.update(out.req_ids, out.token_ids)
        step += 1
    return {k: v.tolist() for k, v in scheduler.finished.items()}


# -- supervision ----------------------------------------------------------------------------
@dataclass
class Supervisor:
    """Spawns worker processes, restarts the dead, applies chaos."""

    argv: list[str]
    workers: int
    max_restarts: int = 1000
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    restarts: int = 0
    kills: int = 0
    stalls: int = 0
    events: list[dict[str, object]] = field(default_factory=list)
    closing: bool = False
    _stalled: dict[int, float] = field(default_factory=dict)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    def start(self) -> None:
        for rank in range(self.workers):
            self.spawn(rank)

    def spawn(self, rank: int) -> None:
        cmd = [sys.executable, "-m", "worker_side.main", *self.argv, "--rank", str(rank)]
        self.procs[rank] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)

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
            if self.restarts >= self.max_restarts:
                raise RuntimeError(f"worker {rank} exited with status {code} and the restart "
                                   f"budget ({self.max_restarts}) is spent; see its log above")
            self.restarts += 1
            self.spawn(rank)
        return out

    def on_event(self, event: object) -> None:
        self.events.append({"event": type(event).__name__, **event.__dict__})
        if isinstance(event, (WorkerDead, WorkerStuck)):
            log.warning("%s", event)
        if isinstance(event, WorkerStuck) and event.rank in self.procs:
            self._signal(event.rank, signal.SIGKILL)  # restarted by tick()

    def chaos(self, step: int, kill_every: int, stall_every: int, stall_seconds: float) -> None:
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


# -- the run ----------------------------------------------------------------------------------
def _security(args: argparse.Namespace, keydir: Path) -> tuple[CurveKeys | None, list[str]]:
    """(CurveKeys or None, extra worker argv) for the chosen endpoint."""
    from engine_side.security import CurveKeys, generate_keypair, load_keypair, load_public

    if args.server_secret_key is not None:
        public, secret = load_keypair(args.server_secret_key)
        allowed = frozenset(load_public(p) for p in args.allow_key)
        server_pub = args.server_secret_key.with_suffix(".key")  # written beside it by zmq
        worker_argv = (["--server-key", str(server_pub), "--secret-key",
                        str(args.worker_secret_key)] if args.worker_secret_key else [])
        if args.worker_secret_key:
            allowed |= {load_keypair(args.worker_secret_key)[0]}
        return CurveKeys(public, secret, allowed), worker_argv
    if not args.curve:
        return None, []
    server_pub, server_secret = generate_keypair(keydir, "engine")
    _, worker_secret = generate_keypair(keydir, "worker")
    public, secret = load_keypair(server_secret)
    allowed = frozenset({load_keypair(worker_secret)[0]})
    return CurveKeys(public, secret, allowed), ["--server-key", str(server_pub),
                                                 "--secret-key", str(worker_secret)]


@dataclass
class Outcome:
    outputs: dict[str, list[int]]
    steps: int
    seconds: float


def drive(args: argparse.Namespace, session: EngineSession, sup: Supervisor) -> Outcome:
    """Run the workload to completion through ``session``."""
    from rich.progress import Progress

    scheduler, jobs = make_scheduler(args), make_jobs(args.seed, args.requests, args.max_tokens)
    started, step = time.monotonic(), 0
    with Progress(disable=args.no_progress, transient=True) as progress:
        task = progress.add_task("requests", total=args.requests)
        while jobs or scheduler.has_work():
            admit(scheduler, jobs, step)
            request = scheduler.schedule()
            answer = session.run_step(request)
            ids = [request.req_ids[i] for i in answer.row_array().tolist()]
            done = scheduler.update(ids, answer.token_array().tolist())
            progress.advance(task, len(done))
            step += 1
            sup.chaos(step, args.kill_every, args.stall, args.stall_seconds)
    outputs = {k: v.tolist() for k, v in scheduler.finished.items()}
    return Outcome(outputs, step, time.monotonic() - started)


def summarize(outcome: Outcome, session: EngineSession, sup: Supervisor,
              reference_ok: bool | None) -> dict[str, object]:
    s = session.stats
    return {
        "steps": outcome.steps, "seconds": round(outcome.seconds, 3),
        "steps_per_s": round(outcome.steps / max(outcome.seconds, 1e-9), 1),
        "bytes_per_step": round(s["bytes"] / max(s["steps"], 1), 1),
        "published_steps": s["steps"], "reissued": s["reissued"], "heartbeats": s["heartbeats"],
        "snapshots": s["snapshots"], "resyncs": s["resyncs"],
        "resyncs_by_rank": {k[11:]: v for k, v in s.items() if k.startswith("resyncs_rank")},
        "restarts": sup.restarts, "kills": sup.kills, "stalls": sup.stalls,
        "compared": s["compared"], "rejoined_compared": s["rejoined_compared"],
        "mismatched": s["mismatched"],
        "divergent_ranks": sorted({d.rank for d in session.divergent}),
        "requests_done": len(outcome.outputs), "reference_ok": reference_ok,
        "events": sup.events,
    }


def _print_summary(summary: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="deltacast demo", show_header=False)
    for key in ("steps", "steps_per_s", "bytes_per_step", "snapshots", "resyncs", "restarts",
                "kills", "stalls", "reissued", "compared", "mismatched", "divergent_ranks",
                "requests_done", "reference_ok"):
        table.add_row(key, str(summary[key]))
    Console(stderr=True).print(table)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from engine_side.security import EndpointError
    from engine_side.transport import EngineTransport

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s engine %(levelname)s %(message)s")
    with tempfile.TemporaryDirectory(prefix="dc-keys-") as keydir:
        keys, key_argv = _security(args, Path(keydir))
        try:
            transport = EngineTransport(args.endpoint, keys=keys, insecure=args.insecure,
                                        sndhwm=args.hwm, sndbuf=args.sockbuf,
                                        ring_bytes=args.ring_kb << 10)
        except EndpointError as exc:
            print(f"deltacast demo: {exc}", file=sys.stderr)
            return 2
        worker_argv = ["--connect", transport.endpoint, "--model-seed", str(args.seed),
                       "--num-blocks", str(args.num_blocks), "--rcvhwm", str(args.hwm),
                       "--rcvbuf", str(args.sockbuf), "--engine-timeout", "10",
                       "--spin-ms", str(args.spin_ms), *key_argv]
        return _run(args, transport, Supervisor(worker_argv, args.workers))


def _run(args: argparse.Namespace, transport: EngineTransport, sup: Supervisor) -> int:
    liveness = LivenessView(dead_after=args.liveness,
                            stuck_after={k: args.stuck_after for k in
                                         ("awaiting_snapshot", "desynced", "synced", "silent")})
    mirror = EngineMirror(epoch=random.SystemRandom().randrange(1 << 32),
                          token_mode=TOKEN_MODE_ENGINE)
    session = EngineSession(transport, mirror, liveness, on_event=sup.on_event,
                            ticks=[lambda now: sup.tick(now, liveness)],
                            ack_spin=args.ack_spin_ms / 1e3)
    try:
        sup.start()
        session.wait_for_workers(args.workers + args.remote_workers, timeout=60.0)
        outcome = drive(args, session, sup)
    finally:
        sup.resume_all()
        session.close("done", expect=set(range(args.workers + args.remote_workers)))
        sup.shutdown()
    reference_ok = None
    if args.reference:
        reference_ok = reference_outputs(args) == outcome.outputs
    summary = summarize(outcome, session, sup, reference_ok)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    ok = (len(outcome.outputs) == args.requests and not session.divergent
          and reference_ok is not False)
    return 0 if ok else 1
