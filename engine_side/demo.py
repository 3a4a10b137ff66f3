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
import errno
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine_side.liveness import LivenessView
from engine_side.mirror import EngineMirror
from engine_side.results import SampledTokens
from engine_side.scheduler import Scheduler
from engine_side.session import DEFAULT_ACK_SPIN, EngineSession, WorkersLost
from engine_side.supervisor import Supervisor, WorkersFailing
from protocol.cli_support import (
    EXIT_ENDPOINT,
    EXIT_IN_USE,
    EXIT_NO_INPUT,
    EXIT_USAGE,
    EXIT_WORKERS_LOST,
    CliError,
    configure_logging,
    deferred_signals,
    endpoint,
    float_in,
    int_in,
)
from protocol.messages import TOKEN_MODE_ENGINE
from protocol.params import SamplingSpec
from protocol.request import IntArray
from protocol.ring import DEFAULT_RING_BYTES
from protocol.stale_dirs import LockedTempDir
from worker_side.waiting import DEFAULT_SPIN_MS

if TYPE_CHECKING:  # zmq is imported only when a run starts
    from engine_side.security import CurveKeys
    from engine_side.transport import EngineTransport

__all__ = ["Supervisor", "WorkersFailing", "add_arguments", "run"]  # (bench latency's soak)

log = logging.getLogger("deltacast.demo")
VOCAB = 512  # TinyModel's default vocabulary
MAX_PROMPT = 80  # longest prompt of make_jobs
MAX_WORKERS = 64  # ranks 0..63 (protocol.ring.MAX_RANKS)
JOIN_TIMEOUT = 60.0  # seconds the engine waits for its workers to join


def add_arguments(parser: argparse.ArgumentParser) -> None:
    run_ = parser.add_argument_group("workload")
    run_.add_argument("--workers", type=int_in(0, MAX_WORKERS), default=2,
                      help="worker processes started here (0 needs --remote-workers)")
    run_.add_argument("--requests", type=int_in(1), default=16,
                      help="requests in the seeded workload")
    run_.add_argument("--seed", type=int_in(0), default=0, help="workload and model seed")
    run_.add_argument("--max-tokens", type=int_in(1, 4096), default=24,
                      help="most tokens a request generates (each draws 1..N)")
    run_.add_argument("--num-blocks", type=int_in(1), default=256,
                      help=f"KV cache blocks of 16 tokens per worker (a request needs "
                           f"{MAX_PROMPT} + --max-tokens tokens at most)")
    run_.add_argument("--token-budget", type=int_in(1), default=128,
                      help="tokens scheduled per step (decodes, then prefill chunks)")
    run_.add_argument("--reference", action="store_true",
                      help="also run the workload in-process and require identical outputs")
    chaos = parser.add_argument_group("chaos")
    chaos.add_argument("--kill-every", type=int_in(1), default=None, metavar="K",
                       help="kill -9 a random local worker every K steps; it is restarted "
                            "and rejoins through a snapshot (off unless given)")
    chaos.add_argument("--stall", type=int_in(1), default=None, metavar="K",
                       help="every K steps, SIGSTOP a random local worker for "
                            "--stall-seconds, then SIGCONT it (off unless given). Stalled "
                            "past --liveness, it is declared dead and the run goes on "
                            "without it; when it wakes it catches up from the step ring if "
                            "the steps it missed still fit there, and otherwise detects the "
                            "gap and resyncs from a snapshot (the summary's 'resyncs'). The "
                            "default ring holds every step of a demo-sized stall; to see "
                            "resyncs shrink it: --stall 10 --stall-seconds 2.5 --ring-kb 1 "
                            "--requests 256")
    chaos.add_argument("--stall-seconds", type=float_in(0, 60, exclusive=True), default=1.5,
                       help="how long a --stall lasts (seconds)")
    net = parser.add_argument_group("endpoint and security")
    net.add_argument("--endpoint", type=endpoint, default=None,
                     help="ipc://DIR (a private directory: ours, mode 0700, no symlink) or "
                          "tcp://HOST:PORT (PORT and PORT+1; needs --curve, "
                          "--server-secret-key or --insecure); default: a fresh private "
                          "ipc directory under $XDG_RUNTIME_DIR or the temp dir")
    net.add_argument("--curve", action="store_true",
                     help="tcp: CURVE encryption with keys generated for this run")
    net.add_argument("--insecure", action="store_true",
                     help="tcp without CURVE: anyone who reaches the port can read and "
                          "inject (trusted networks only; warns)")
    net.add_argument("--server-secret-key", type=Path, metavar="FILE",
                     help="tcp: the engine's .key_secret file (instead of --curve)")
    net.add_argument("--allow-key", type=Path, action="append", default=[], metavar="FILE",
                     help="with --server-secret-key: a worker public key file to admit "
                          "(repeatable)")
    net.add_argument("--worker-secret-key", type=Path, metavar="FILE",
                     help="with --server-secret-key: the key file locally started workers use")
    net.add_argument("--remote-workers", type=int_in(0, MAX_WORKERS), default=0,
                     help="also wait for this many hand-started workers (`deltacast worker "
                          "--connect ENDPOINT --rank R`, ranks after the local ones)")
    tune = parser.add_argument_group("liveness and tuning")
    tune.add_argument("--liveness", type=float_in(0, exclusive=True), default=1.0,
                      help="a worker without a check-in this long (seconds) is dead: the "
                           "run goes on without it")
    tune.add_argument("--stuck-after", type=float_in(0, exclusive=True), default=10.0,
                      help="a worker alive but without progress this long (seconds) is "
                           "killed and restarted")
    tune.add_argument("--hwm", type=int_in(0), default=1000,
                      help="PUB/SUB high-water mark in messages (0 = unlimited)")
    tune.add_argument("--sockbuf", type=int_in(-1), default=-1,
                      help="kernel socket buffer bytes (-1 = the OS default)")
    tune.add_argument("--ring-kb", type=int_in(0, 1 << 20), default=DEFAULT_RING_BYTES >> 10,
                      help="ipc: the shared-memory step ring's size in KiB (a worker "
                           "stalled past it resyncs; 0 = sockets only)")
    tune.add_argument("--spin-ms", type=float_in(0), default=DEFAULT_SPIN_MS,
                      help="workers' bounded spin after each step, ms (0 = block)")
    tune.add_argument("--ack-spin-ms", type=float_in(0), default=DEFAULT_ACK_SPIN * 1e3,
                      help="engine's bounded spin while waiting for a step, ms (0 = block)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print the summary as one JSON line on stdout (instead of a table)")
    out.add_argument("--no-progress", action="store_true",
                     help="no progress bar (there is none when stderr is not a terminal)")


def check_args(args: argparse.Namespace) -> None:
    """What argparse cannot check alone (CliError with a one-line message)."""
    def usage(text: str) -> CliError:
        return CliError(text, EXIT_USAGE)

    if args.workers + args.remote_workers < 1:
        raise usage("no workers: give --workers N (N >= 1), or --remote-workers N for "
                    "hand-started ones")
    if args.workers + args.remote_workers > MAX_WORKERS:
        raise usage(f"at most {MAX_WORKERS} workers in all (--workers + --remote-workers)")
    if (args.kill_every or args.stall) and args.workers < 1:
        raise usage("--kill-every and --stall act on local workers: give --workers N")
    need = MAX_PROMPT + args.max_tokens
    if args.num_blocks * 16 < need:
        raise usage(f"--num-blocks {args.num_blocks} holds {args.num_blocks * 16} tokens, "
                    f"but a request may need {need} ({MAX_PROMPT} prompt + --max-tokens): "
                    f"use --num-blocks {-(-need // 16)} or more")
    for path in (args.server_secret_key, args.worker_secret_key, *args.allow_key):
        if path is not None and not path.is_file():
            raise CliError(f"{path}: no such key file (make them with `deltacast keys DIR`, "
                           "or use --curve)", EXIT_NO_INPUT)
    if args.curve and args.server_secret_key is not None:
        raise usage("--curve generates keys; --server-secret-key brings your own: choose one")
    if args.server_secret_key is None and (args.allow_key or args.worker_secret_key):
        raise usage("--allow-key and --worker-secret-key go with --server-secret-key")
    if args.server_secret_key is not None and args.workers and args.worker_secret_key is None:
        raise usage("with --server-secret-key, local workers need --worker-secret-key (or "
                    "start them by hand: --workers 0 --remote-workers N)")


# -- workload and reference --------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    req_id: str
    arrival: int  # step at which it is added
    prompt: IntArray
    max_tokens: int
    sampling: SamplingSpec | None


def make_jobs(seed: int, count: int, max_tokens: int) -> list[Job]:
    """Seeded requests: prompts of 4..MAX_PROMPT tokens, half greedy, half seeded top-k
    sampling."""
    rng = np.random.default_rng(seed)
    jobs = []
    for i in range(count):
        sampling = None if i % 2 == 0 else SamplingSpec(temperature=0.8, top_k=40, seed=i)
        arrival = int(rng.integers(0, 2 * count))  # (draw order kept: seeds reproduce)
        prompt = rng.integers(0, VOCAB, int(rng.integers(4, MAX_PROMPT + 1))).astype(np.int64)
        jobs.append(Job(f"req-{i}", arrival, prompt, int(rng.integers(1, max_tokens + 1)),
                        sampling))
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
        local: dict[bytes, frozenset[int]] = {}  # the local workers' key speaks for their ranks
        if args.worker_secret_key:
            local[load_keypair(args.worker_secret_key)[0]] = frozenset(range(args.workers))
        return CurveKeys(public, secret, allowed | set(local), local), worker_argv
    if not args.curve:
        return None, []
    server_pub, server_secret = generate_keypair(keydir, "engine")
    _, worker_secret = generate_keypair(keydir, "worker")
    public, secret = load_keypair(server_secret)
    worker = load_keypair(worker_secret)[0]  # shared by the local workers: pinned to their ranks
    return CurveKeys(public, secret, frozenset({worker}), {worker: frozenset(range(args.workers))}
                     ), ["--server-key", str(server_pub),
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
    from rich.console import Console

    quiet = args.no_progress or args.json or not sys.stderr.isatty()
    with Progress(console=Console(stderr=True), disable=quiet, transient=True) as progress:
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
        "resyncs_by_rank": {k.removeprefix("resyncs_rank"): v for k, v in s.items()
                            if k.startswith("resyncs_rank")},
        "restarts": sup.restarts, "kills": sup.kills, "stalls": sup.stalls,
        "compared": s["compared"], "rejoined_compared": s["rejoined_compared"],
        "mismatched": s["mismatched"],
        "divergent_ranks": sorted({d.rank for d in session.divergent}),
        "bad_results": s["bad_results"], "refused": session.refusals(),
        "engine_cpu_s": round(session.cpu_seconds, 3),
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
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    verbosity = getattr(args, "verbose", 0)
    configure_logging(verbosity, "engine")
    with LockedTempDir("keys") as keydir:
        keys, key_argv = _checked_security(args, keydir)
        transport = _transport(args, keys)
        worker_argv = ["--connect", transport.endpoint, "--model-seed", str(args.seed),
                       "--num-blocks", str(args.num_blocks), "--rcvhwm", str(args.hwm),
                       "--rcvbuf", str(args.sockbuf), "--engine-timeout", "10",
                       "--spin-ms", str(args.spin_ms), *key_argv, *["-v"] * verbosity,
                       *(["--debug"] if getattr(args, "debug", False) else [])]
        sup = Supervisor(worker_argv, args.workers,
                         chaos_on=bool(args.kill_every or args.stall))
        return _run(args, transport, sup)


def _checked_security(args: argparse.Namespace,
                      keydir: Path) -> tuple[CurveKeys | None, list[str]]:
    """:func:`_security`, its failures as one-line CliErrors."""
    from engine_side.security import EndpointError

    try:
        return _security(args, keydir)
    except EndpointError as exc:  # e.g. a key file without its secret
        raise CliError(str(exc), EXIT_ENDPOINT) from exc
    except (ValueError, OSError) as exc:  # not a key file at all
        raise CliError(f"cannot read the CURVE keys: {exc} (pass files written by "
                       "`deltacast keys DIR`)", EXIT_NO_INPUT) from exc


def _transport(args: argparse.Namespace, keys: CurveKeys | None) -> EngineTransport:
    """The bound transport, or a CliError saying why the endpoint cannot be used."""
    import zmq

    from engine_side.security import EndpointError, EndpointInUse
    from engine_side.transport import EngineTransport

    where = args.endpoint or "a private ipc directory"
    try:
        return EngineTransport(args.endpoint, keys=keys, insecure=args.insecure,
                               sndhwm=args.hwm, sndbuf=args.sockbuf,
                               ring_bytes=args.ring_kb << 10)
    except EndpointInUse as exc:
        raise CliError(str(exc), EXIT_IN_USE) from exc
    except EndpointError as exc:
        raise CliError(str(exc), EXIT_ENDPOINT) from exc
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise CliError(f"{where}: address already in use (the engine binds PORT and "
                           "PORT+1): stop what listens there or choose another port",
                           EXIT_IN_USE) from exc
        if exc.errno in (errno.EADDRNOTAVAIL, errno.ENODEV, errno.EINVAL):
            raise CliError(f"cannot bind {where}: {exc.strerror} (HOST must be an address "
                           "of this machine, or *)", EXIT_ENDPOINT) from exc
        raise
    except OSError as exc:  # e.g. creating the ipc directory
        raise CliError(f"cannot use {where}: {exc.strerror}: {exc.filename}; choose a "
                       "directory you own", EXIT_ENDPOINT) from exc


def _run(args: argparse.Namespace, transport: EngineTransport, sup: Supervisor) -> int:
    liveness = LivenessView(dead_after=args.liveness,
                            stuck_after={k: args.stuck_after for k in
                                         ("awaiting_snapshot", "desynced", "synced", "silent")})
    mirror = EngineMirror(epoch=random.SystemRandom().randrange(1 << 32),
                          token_mode=TOKEN_MODE_ENGINE)
    session = EngineSession(transport, mirror, liveness, on_event=sup.on_event,
                            ticks=[lambda now: sup.tick(now, liveness),
                                   lambda now: session.peers.follow(sup.procs)],
                            ack_spin=args.ack_spin_ms / 1e3,
                            ranks=range(args.workers + args.remote_workers),
                            validate=SampledTokens(VOCAB))  # a bad result: its rank's fault
    total, finished = args.workers + args.remote_workers, False
    try:
        sup.start()
        session.peers.follow(sup.procs)  # each local rank is the process spawned for it
        if args.remote_workers:
            ranks = (str(args.workers) if args.remote_workers == 1
                     else f"R (one each of {args.workers}..{total - 1})")
            print(f"deltacast demo: waiting for {args.remote_workers} hand-started "
                  f"worker(s): deltacast worker --connect {transport.endpoint} --rank "
                  f"{ranks}", file=sys.stderr)
        session.wait_for_workers(total, timeout=JOIN_TIMEOUT)
        log.info("all %d workers joined; running %d requests", total, args.requests)
        outcome = drive(args, session, sup)
        finished = True
    except WorkersLost as exc:
        raise CliError(f"{exc}; the workers' messages above say why", EXIT_WORKERS_LOST) \
            from exc
    finally:
        with deferred_signals():  # a signal now waits until everything is cleaned up
            _stop(session, sup, total, finished)
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


def _stop(session: EngineSession, sup: Supervisor, total: int, finished: bool) -> None:
    """Goodbye to the workers, close the sockets and the run directory, reap the workers
    (those that never joined are killed at once when the run was cut short)."""
    sup.resume_all()
    if not finished:
        sup.kill_unjoined()
    try:
        session.close("done" if finished else "engine stopping", expect=set(range(total)))
    except Exception:  # cut short mid-step: the sockets and files still go
        log.debug("closing the session failed", exc_info=True)
    finally:
        session.transport.close()  # (idempotent)
        sup.shutdown(5.0 if finished else 3.0)
