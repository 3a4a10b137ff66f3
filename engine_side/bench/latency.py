"""``deltacast bench latency``: end-to-end step latency over real sockets and processes.

One case = (transport, workers, batch).  The engine (this process) steps a
synthetic workload through an :class:`EngineSession`; ``--ack-only`` worker
processes apply each delta, rebuild the full request and acknowledge it.  A
step's latency runs from "the engine hands over the request" (before the diff)
to "every worker has acknowledged holding the rebuilt request".  Lanes: ``ipc`` (the
default local channel: Deltas and acks through the shared-memory step ring of
:mod:`worker_side.ring`), ``ipc-sockets`` (the same without the ring), ``tcp-curve``.  Rows follow
:mod:`engine_side.bench.rows`: ``encode_us`` = diff + publish on the engine,
``decode_us`` = the rest of the round trip (transit, apply, rebuild, ack),
``total_us`` = median latency.  Extra keys: ``p99_us``, ``cpu_s_per_step``
(engine + all workers, from process CPU clocks), ``transport``, ``steps``.
Both sides wait as in production: workers spin (bounded, ``sched_yield`` between
polls) for ``--spin-ms`` after each step, the engine for ``--ack-spin-ms`` while it
waits for acks; 0 makes either block.

Baseline ``vllm-shm`` (only where vLLM is importable): vLLM 0.32's shared-memory
``MessageQueue`` broadcasting the pickled ``("execute_model", (SchedulerOutput,),
{}, 0)`` tuple to local reader processes, which ack on a pipe once ``dequeue()``
has unpickled it.  Building the SchedulerOutput is left untimed (vLLM's scheduler
builds it anyway), so the baseline's latency starts at ``enqueue``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from engine_side.bench.rows import Row, dumps, make_row
from engine_side.liveness import LivenessView
from engine_side.mirror import EngineMirror
from engine_side.security import free_tcp_endpoint
from engine_side.session import DEFAULT_ACK_SPIN, EngineSession, WorkersLost
from engine_side.workloads import Workload
from protocol.cli_support import float_in, int_in
from protocol.ring import DEFAULT_RING_BYTES
from protocol.stale_dirs import LockedTempDir
from worker_side.waiting import DEFAULT_SPIN_MS

SCENARIO = "steady_decode"
# ipc: the default local channel (step ring + ipc sockets); ipc-sockets: without the ring
TRANSPORTS = ("ipc", "ipc-sockets", "tcp-curve", "vllm-shm")  # vllm-shm: where vLLM imports
_TICKS = os.sysconf("SC_CLK_TCK")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transports", type=_transport_list, default=",".join(TRANSPORTS),
                        help="latency: comma-separated subset of " + ",".join(TRANSPORTS))
    parser.add_argument("--worker-counts", type=_count_list, default="1,2,4",
                        help="latency: comma-separated worker counts (default 1,2,4)")
    parser.add_argument("--spin-ms", type=float_in(0), default=DEFAULT_SPIN_MS,
                        help="latency: workers' bounded spin after each step "
                             f"(default {DEFAULT_SPIN_MS:g}; 0 = block)")
    parser.add_argument("--ack-spin-ms", type=float_in(0), default=DEFAULT_ACK_SPIN * 1e3,
                        help="latency: the engine's bounded spin while it waits for acks "
                             f"(default {DEFAULT_ACK_SPIN * 1e3:g}; 0 = block)")
    parser.add_argument("--soak", type=int_in(0), default=0, metavar="STEPS",
                        help="latency: instead, a soak run of STEPS steps with 4 workers, "
                             "random kills and stalls (prints one JSON summary; 0 = off)")
    parser.add_argument("--soak-kill-every", type=int_in(1), default=5000, metavar="K",
                        help="latency --soak: kill -9 a random worker every K steps")
    parser.add_argument("--soak-stall-every", type=int_in(1), default=7000, metavar="K",
                        help="latency --soak: SIGSTOP a random worker for 3 s every K steps")


def _transport_list(text: str) -> str:
    """An argparse type: a comma-separated subset of TRANSPORTS (returned as given)."""
    names = [t for t in text.split(",") if t]
    unknown = [t for t in names if t not in TRANSPORTS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(TRANSPORTS)}")
    return text


def _count_list(text: str) -> str:
    """An argparse type: comma-separated worker counts in 1..64 (returned as given)."""
    try:
        counts = _ints(text)
    except ValueError:
        counts = ()
    if not counts or min(counts) < 1 or max(counts) > 64:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated worker counts in 1..64")
    return text


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


@contextmanager
def _engine(transport: str, workers: int, token_mode: int, spin: tuple[float, float]
            ) -> Iterator[tuple[EngineSession, list[subprocess.Popen[bytes]]]]:
    """An engine session with ``workers`` ack-only worker processes joined."""
    from engine_side.security import CurveKeys, generate_keypair, load_keypair
    from engine_side.transport import EngineTransport

    with LockedTempDir("bench") as tmp:  # (removed by a later sweep after a kill -9)
        keys, extra, endpoint = None, [], None
        if transport == "tcp-curve":
            server_pub, server_secret = generate_keypair(Path(tmp), "engine")
            _, worker_secret = generate_keypair(Path(tmp), "worker")
            worker_key = load_keypair(worker_secret)[0]  # shared: pinned to the ranks
            keys = CurveKeys(*load_keypair(server_secret), frozenset({worker_key}),
                             {worker_key: frozenset(range(workers))})
            extra = ["--server-key", str(server_pub), "--secret-key", str(worker_secret)]
            endpoint = free_tcp_endpoint()
        ring = DEFAULT_RING_BYTES if transport == "ipc" else 0
        session = EngineSession(EngineTransport(endpoint, keys=keys, ring_bytes=ring),
                                EngineMirror(token_mode=token_mode), LivenessView(dead_after=5.0),
                                ack_spin=spin[1] / 1e3)
        cmd = [sys.executable, "-m", "worker_side.main", "--ack-only", "--connect",
               session.transport.endpoint, "--engine-timeout", "30",
               "--spin-ms", str(spin[0]), *extra]
        logs = [Path(tmp) / f"worker{r}.log" for r in range(workers)]
        procs = []
        for rank, log in enumerate(logs):
            with log.open("wb") as err:  # the child keeps its own copy of the descriptor
                procs.append(subprocess.Popen([*cmd, "--rank", str(rank)],
                                              stdin=subprocess.DEVNULL, stderr=err))
        try:
            try:
                session.wait_for_workers(workers, timeout=120)
            except WorkersLost:
                for log in logs:  # say why before giving up
                    print(f"--- {log.name}\n{log.read_text()[-2000:]}", file=sys.stderr)
                raise
            yield session, procs
        finally:
            session.close("bench done", expect=set(range(workers)))
            for p in procs:
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def bench_case(transport: str, workers: int, batch: int, steps: int, seed: int,
               spin: tuple[float, float] = (DEFAULT_SPIN_MS, DEFAULT_ACK_SPIN * 1e3)) -> Row:
    """One (transport, workers, batch) row; ``spin`` = (worker, engine ack) spin in ms."""
    workload = Workload(SCENARIO, batch, seed=seed)
    with _engine(transport, workers, workload.token_mode, spin) as (session, procs):
        for req in workload.warmup():
            session.run_step(req)
        # generated outside the CPU window, with their changes as the workload knows them
        requests = [(workload.step(), workload.changes) for _ in range(steps)]
        cpu0 = time.process_time() + sum(cpu_seconds(p.pid) for p in procs)
        sent: list[int] = []
        latency: list[int] = []
        sizes: list[int] = []
        for req, changes in requests:
            before = session.stats["bytes"]
            t0 = time.perf_counter_ns()
            seq = session.publish_step(req, changes)
            t1 = time.perf_counter_ns()
            if session.wait_step(seq) is None:
                raise RuntimeError("a worker fell out during the benchmark")
            latency.append(time.perf_counter_ns() - t0)
            sent.append(t1 - t0)
            sizes.append(session.stats["bytes"] - before)
        cpu = time.process_time() + sum(cpu_seconds(p.pid) for p in procs) - cpu0
    return _latency_row(transport, "deltacast", workers, batch, steps, latency, sent, sizes, cpu)


# -- vLLM's shared-memory MessageQueue carrying the pickled SchedulerOutput ------------------
@contextmanager
def _vllm_queue(workers: int) -> Iterator[tuple[Any, list[subprocess.Popen[bytes]], list[int]]]:
    """A vLLM MessageQueue writer with ``workers`` local reader processes acking on pipes."""
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    mq = MessageQueue(n_reader=workers, n_local_reader=workers)
    handle = json.dumps(dataclasses.asdict(mq.export_handle()))
    procs, acks = [], []
    for rank in range(workers):
        read_fd, write_fd = os.pipe()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "engine_side.bench.latency", "--vllm-reader", handle,
             str(rank), str(write_fd)], pass_fds=(write_fd,), stdin=subprocess.DEVNULL))
        os.close(write_fd)
        acks.append(read_fd)
    try:
        mq.wait_until_ready()
        yield mq, procs, acks
    finally:
        mq.enqueue(None)  # readers exit
        for p in procs:
            p.wait(30)
        for fd in acks:
            os.close(fd)


def _vllm_reader(handle_json: str, rank: int, ack_fd: int) -> int:
    """Reader process: dequeue (vLLM unpickles), ack one byte per message; None ends."""
    from vllm.distributed.device_communicators.shm_broadcast import Handle, MessageQueue

    fields = json.loads(handle_json)
    for key in ("buffer_handle", "tensor_arena_handle"):
        if fields.get(key) is not None:
            fields[key] = tuple(fields[key])
    mq = MessageQueue.create_from_handle(Handle(**fields), rank)
    mq.wait_until_ready()
    while mq.dequeue() is not None:
        os.write(ack_fd, b"\x01")
    return 0


def vllm_cases(workers: int, cases: list[tuple[int, int]], seed: int) -> Iterator[Row]:
    """Rows for vLLM's path: SchedulerOutput built untimed, then enqueue → all readers hold it."""
    from engine_side.bench.baselines import V1Scheduler, frames_size, pickle_frames, rpc_message

    with _vllm_queue(workers) as (mq, procs, acks):
        for batch, steps in cases:
            workload, convert = Workload(SCENARIO, batch, seed=seed), V1Scheduler()
            for req in workload.warmup():
                mq.enqueue(rpc_message(convert.convert(req)))
                for fd in acks:
                    os.read(fd, 1)
            # SchedulerOutputs are built before the CPU window: vLLM's scheduler makes them anyway
            messages = [rpc_message(convert.convert(workload.step())) for _ in range(steps)]
            sizes = [frames_size(pickle_frames(m)) for m in messages]
            latency, sent = [], []
            cpu0 = time.process_time() + sum(cpu_seconds(p.pid) for p in procs)
            for message in messages:
                t0 = time.perf_counter_ns()
                mq.enqueue(message)
                t1 = time.perf_counter_ns()
                for fd in acks:
                    os.read(fd, 1)
                latency.append(time.perf_counter_ns() - t0)
                sent.append(t1 - t0)
            cpu = time.process_time() + sum(cpu_seconds(p.pid) for p in procs) - cpu0
            yield _latency_row("vllm-shm", "vllm_mq_pickle_v1", workers, batch, steps, latency,
                               sent, sizes, cpu)


def _latency_row(transport: str, fmt: str, workers: int, batch: int, steps: int,
                 latency: list[int], sent: list[int], sizes: list[int], cpu: float) -> Row:
    lat_us = np.array(latency) / 1e3
    enc_us = float(np.median(sent)) / 1e3
    total = float(np.median(lat_us))
    return make_row(f"latency-{transport}", batch, workers, fmt, int(np.median(sizes)),
                    enc_us, total - enc_us, p99_us=round(float(np.percentile(lat_us, 99)), 1),
                    cpu_s_per_step=round(cpu / steps, 6), transport=transport, steps=steps)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v.strip())


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def soak(args: argparse.Namespace, workers: int = 4, batch: int = 64) -> dict[str, object]:
    """Many steps of a churning workload with kill -9 and SIGSTOP chaos; every answer's
    replica digest must equal the engine's (ack-only workers report their digest)."""
    from engine_side.demo import Supervisor
    from engine_side.transport import EngineTransport

    workload = Workload("mixed_chat", batch, seed=args.seed)
    # small HWM and ring: stalls overflow and force resyncs
    transport = EngineTransport(None, sndhwm=64, ring_bytes=64 << 10)
    liveness = LivenessView(dead_after=1.0, stuck_after={"synced": 10.0, "silent": 10.0})
    sup = Supervisor(["--ack-only", "--connect", transport.endpoint, "--engine-timeout", "30",
                      "--rcvhwm", "64"], workers)
    session = EngineSession(transport, EngineMirror(token_mode=workload.token_mode), liveness,
                            on_event=sup.on_event, ticks=[lambda now: sup.tick(now, liveness)])
    rss, bad, started = [_rss_kb()], 0, time.monotonic()
    try:
        sup.start()
        session.wait_for_workers(workers, timeout=60)
        for step in range(1, args.soak + 1):
            answer = session.run_step(workload.step())
            bad += answer.tokens != session.mirror.state.digest.to_bytes(8, "little")
            sup.chaos(step, args.soak_kill_every, args.soak_stall_every, 3.0)
            if step % 10_000 == 0:
                rss.append(_rss_kb())
    finally:
        sup.resume_all()
        session.close("soak done", expect=set(range(workers)))
        sup.shutdown()
    s = session.stats
    return {"steps": args.soak, "workers": workers, "batch": batch,
            "seconds": round(time.monotonic() - started, 1), "kills": sup.kills,
            "stalls": sup.stalls, "restarts": sup.restarts, "resyncs": s["resyncs"],
            "reissued": s["reissued"], "compared": s["compared"], "mismatched": s["mismatched"],
            "digest_mismatches": bad, "bytes_per_step": round(s["bytes"] / s["steps"], 1),
            "engine_rss_kb": rss}


def run(args: argparse.Namespace) -> int:
    if getattr(args, "soak", 0):
        import json

        summary = soak(args)
        print(json.dumps(summary), flush=True)
        return 0 if summary["mismatched"] == 0 and summary["digest_mismatches"] == 0 else 1
    quick = bool(getattr(args, "quick", False))
    batches = args.batches or ((1, 256) if quick else (1, 256, 4096))
    counts = (1,) if quick else _ints(getattr(args, "worker_counts", "1,2,4"))
    transports = [t for t in getattr(args, "transports", ",".join(TRANSPORTS)).split(",") if t]
    if "vllm-shm" in transports and importlib.util.find_spec("vllm") is None:
        print("bench latency: vLLM is not importable here; skipping the vllm-shm baseline "
              "(run with a Python that has vLLM, e.g. PYTHONPATH=. /path/vllm-venv/bin/python "
              "-m engine_side.cli bench latency)", file=sys.stderr)
        transports.remove("vllm-shm")
    spin = (getattr(args, "spin_ms", DEFAULT_SPIN_MS),
            getattr(args, "ack_spin_ms", DEFAULT_ACK_SPIN * 1e3))
    for workers in counts:  # lanes of one worker count run back to back: similar machine load
        for transport in transports:
            cases = [(b, args.steps or (5 if quick else 200 if b <= 256 else 40)) for b in batches]
            rows = (vllm_cases(workers, cases, args.seed) if transport == "vllm-shm" else
                    (bench_case(transport, workers, b, n, args.seed, spin) for b, n in cases))
            for row in rows:
                print(dumps(row) if args.json else _human(row), flush=True)
    return 0


def _human(row: Row) -> str:
    return (f"{row['transport']:>9} workers={row['workers']} batch={row['batch']:>5}: "
            f"p50 {row['total_us']:>9.1f} us  p99 {row['p99_us']:>9.1f} us  "
            f"{row['bytes']:>7} B/step  cpu {row['cpu_s_per_step'] * 1e3:.3f} ms/step")


if __name__ == "__main__":  # vLLM reader processes: --vllm-reader HANDLE_JSON RANK ACK_FD
    if len(sys.argv) == 5 and sys.argv[1] == "--vllm-reader":
        sys.exit(_vllm_reader(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
    sys.exit("usage: python -m engine_side.bench.latency --vllm-reader HANDLE RANK FD")
