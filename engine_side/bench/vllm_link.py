"""Benchmark: step latency across two hosts, deltacast's channel against vLLM's MessageQueue.

::

    .venv/bin/python -m engine_side.bench.vllm_link --json out/vllm_link.json \\
        --figures docs/benchmarks/vllm_link.json [--steps N] [--running 256,4096] \\
        [--streams online256] [--floor]

Two network namespaces joined by a veth pair shaped to 1 Gbit/s (:mod:`engine_side.bench.
netns`; ``tbf`` only: this kernel has no ``netem``, so no added delay; needs root) stand
for two hosts.  A sender in A plays the engine, a receiver in B one remote rank; they
replay the request path (``execute_model`` and ``sample_tokens`` messages) of synthetic
vLLM streams (:func:`~engine_side.bench.vllm_replay.synthetic_decode`,
:func:`~engine_side.bench.vllm_replay.synthetic_churn`) and of recorded ones (``--streams``:
object streams of real vLLM runs, as :mod:`engine_side.bench.vllm_streams` records them
into ``out/objstreams``) through two channels, in
lockstep (step i+1 leaves once the rank has answered step i, as a real rank's answer
gates the next step):

* ours: the encoder (:class:`~engine_side.vllm.encoder.SchedulerOutputEncoder`) and the
  executor's call to a remote node (one frame, ``pack_relayed([*, call head, *frames])``,
  on a CURVE ROUTER), received by the node's relay (:mod:`worker_side.vllm.relay`, in a
  process of its own as in ``deltacast node``) and handed through the node's step ring
  (the rank woken by its doorbell FIFO) to the rank's own call loop (``RankChannel``
  and the server of :mod:`worker_side.vllm.proc`; it does not spin, as the executor
  tells remote ranks),
  which answers each call on its DEALER as an output rank does (an empty reply: its
  model returns nothing; other ranks answer step calls 64 at a time, SPEC §16.1);
* vLLM: ``MessageQueue(n_reader=1, n_local_reader=0)`` (a remote reader over TCP)
  carrying the MultiprocExecutor's ``("execute_model", (scheduler_output,), {}, 0)``;
  the reader answers on a plain TCP ZMQ socket.

Latency of a step = when the rank holds it (ours: the decoded object handed to the
worker's ``execute_model``; vLLM: ``dequeue`` returned) − when the engine started
handing it over (ours: before encoding; vLLM: before ``enqueue``, its pickling
included), both on the one machine's monotonic clock.  Bytes per step: A's veth
``tx_bytes`` over a run (frames, headers and TCP acks included) ÷ steps.  Rounds
alternate which path goes first; figures are medians of rounds.

``python -m engine_side.bench.vllm_link sender|receiver ...`` are the two processes
(started by :func:`run` in the namespaces).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from engine_side.bench import netns
from engine_side.bench.vllm_scenarios import percentile

ROOT = Path(__file__).resolve().parents[2]
MODULE = "engine_side.bench.vllm_link"
CTL_PORT, CALL_PORT = 29621, 29622  # in namespace A (each namespace has its own ports)
WORKLOADS = ("decode", "churn")
PATHS = ("ours", "vllm")
WAIT_MS = 120_000  # a peer silent this long: the run fails
LINK = "veth pair, tbf 1 Gbit/s (this kernel has no netem: no added delay)"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


# ---------------------------------------------------------------- shared
def stream(workload: str, running: int, steps: int) -> list[tuple[str, Any]]:
    """The request-path messages of a synthetic stream (one step = one message)."""
    from engine_side.bench.vllm_replay import REQUEST, synthetic_churn, synthetic_decode

    make = synthetic_decode if workload == "decode" else synthetic_churn
    return [(k, o) for k, o in make(running, steps) if k in REQUEST]


def recorded(path: str) -> tuple[str, int, list[tuple[str, Any]]]:
    """A recorded object stream's name (its file's stem), median running requests and
    request-path messages."""
    from engine_side.bench.vllm_replay import REQUEST, load_stream

    msgs = [(k, o) for k, o in load_stream(Path(path)) if k in REQUEST]
    batches = [len(o.num_scheduled_tokens) for k, o in msgs if k == "execute_model"]
    if not batches:
        raise ValueError(f"vllm_link: {path} holds no execute_model step")
    return Path(path).stem, round(statistics.median(batches)), msgs


def messages(spec: dict[str, Any]) -> list[tuple[str, Any]]:
    """The messages of a run's workload: its recorded stream's, or a synthetic one's."""
    if spec.get("stream"):
        return recorded(spec["stream"])[2]
    return stream(spec["workload"], spec["running"], spec["steps_arg"])


def compare(path: str, kind: str, expected: Any, got: Any) -> list[str]:
    """Where what the rank holds differs from what was sent (tests/vllm_equal.py): ours
    the decoded object, vLLM's the whole dequeued RPC tuple."""
    from engine_side.bench.vllm_replay import vllm_message
    from engine_side.bench.vllm_streams import _differences

    if path == "vllm":
        expected = vllm_message(kind, expected)
    return _differences()(expected, got)


def _recv(sock: zmq.Socket[bytes], what: str) -> list[bytes]:
    if not sock.poll(WAIT_MS):
        raise TimeoutError(f"vllm_link: no {what} in {WAIT_MS / 1e3:.0f} s")
    return sock.recv_multipart()


def _json(sock: zmq.Socket[bytes], what: str) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(_recv(sock, what)[0])
    return out


# ---------------------------------------------------------------- the engine's side (A)
class Sender:
    """Binds the control socket, our ROUTER (CURVE server) and vLLM's queue in A."""

    def __init__(self, addr: str, dev: str) -> None:
        from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

        self.dev, self.secret = dev, os.urandom(32)
        self.first = 0  # tx_bytes once a run's first step was answered
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ctl = self.ctx.socket(zmq.PAIR)
        self.ctl.bind(f"tcp://{addr}:{CTL_PORT}")
        self.router = self.ctx.socket(zmq.ROUTER)
        public, secret = zmq.curve_keypair()
        self.router.curve_server = True  # no ZAP allow-list: any client key (a bench)
        self.router.curve_publickey, self.router.curve_secretkey = public, secret
        self.router.bind(f"tcp://{addr}:{CALL_PORT}")
        self.mq = MessageQueue(n_reader=1, n_local_reader=0, connect_ip=addr)
        # the session's keys and handle over the plain control socket (a bench only)
        self.ctl.send_json({"op": "hello", "server_key": public.decode(),
                            "secret": self.secret.hex(), "call": f"tcp://{addr}:{CALL_PORT}",
                            "handle": dataclasses.asdict(self.mq.export_handle())})
        self.mq.wait_until_ready()
        from protocol.calls import READY

        self.route = b""  # the relay's session, from its first message
        if self._answer("rank hello")[1:] != [READY]:
            raise RuntimeError("vllm_link: the rank did not say ready")

    def _call(self, frames: list[Any]) -> None:
        """A call to every rank of the node, as the executor's RemoteRanks.broadcast."""
        from protocol.calls import RELAY_ALL, pack_relayed

        self.router.send_multipart([self.route, pack_relayed([RELAY_ALL, *frames])],
                                   copy=False)

    def _answer(self, what: str) -> list[bytes]:
        from protocol.calls import unpack_relayed

        route, payload = _recv(self.router, what)
        self.route = self.route or route
        return [bytes(f) for f in unpack_relayed(payload)]

    def tx(self) -> int:
        return int(Path(f"/sys/class/net/{self.dev}/statistics/tx_bytes").read_text())

    def run(self, path: str, msgs: list[tuple[str, Any]], spec: dict[str, Any]) -> dict[str, Any]:
        """One lockstep replay of ``msgs`` on ``path``: start stamps, holds, bytes."""
        self.ctl.send_json({"op": "run", "path": path, "n": len(msgs), **spec})
        _json(self.ctl, "receiver ready")
        send = self._ours(msgs) if path == "ours" else self._vllm(msgs)
        self.first, tx0 = 0, self.tx()
        starts = send()
        tx = self.tx() - tx0
        if path == "ours":  # ends the rank's call loop
            from protocol import calls as wire

            self._call([wire.call_head(wire.QUIT, len(msgs) + 1, [])])
        report = _json(self.ctl, "receiver report")
        return {"path": path, **spec, "steps": len(msgs), "starts": starts, "tx_bytes": tx,
                "first_tx_bytes": self.first - tx0, **report}

    def _ours(self, msgs: list[tuple[str, Any]]) -> Callable[[], list[int]]:
        from engine_side.vllm.encoder import SchedulerOutputEncoder
        from protocol import calls as wire

        enc = SchedulerOutputEncoder(secret=self.secret)
        route: dict[str, tuple[bytes, Callable[[Any], list[Any]]]] = {
            "execute_model": (wire.EXECUTE, enc.encode),
                 "sample_tokens": (wire.SAMPLE, enc.encode_grammar)}

        def send() -> list[int]:
            starts = []
            for n, (kind, obj) in enumerate(msgs, 1):
                code, encode = route[kind]
                starts.append(time.monotonic_ns())
                frames = encode(obj)  # as the executor's _broadcast sends to a remote rank
                self._call([wire.call_head(code, n, frames), *frames])
                answer = self._answer(f"answer to call {n}")
                self.first = self.first or self.tx()  # (between steps: not timed)
                if answer[1:2] != [wire.OUTPUT]:
                    raise RuntimeError(f"vllm_link: rank answered {answer[1:2]!r}: "
                                       f"{b''.join(answer[2:]).decode(errors='replace')}")
            return starts

        return send

    def _vllm(self, msgs: list[tuple[str, Any]]) -> Callable[[], list[int]]:
        from engine_side.bench.vllm_replay import vllm_message

        def send() -> list[int]:
            starts = []
            for i, (kind, obj) in enumerate(msgs):
                message = vllm_message(kind, obj)  # MultiprocExecutor's RPC tuple
                starts.append(time.monotonic_ns())
                self.mq.enqueue(message)
                _recv(self.ctl, f"ack of step {i}")
                self.first = self.first or self.tx()
            return starts

        return send

    def close(self) -> None:
        self.ctl.send_json({"op": "quit"})
        for s in (self.ctl, self.router):
            s.close(linger=1000)


def sender_main(args: argparse.Namespace) -> int:
    """Warm both paths up, then ``rounds`` rounds over every workload; JSON to --out."""
    running = [int(x) for x in args.running.split(",") if x]
    work = {(w, n, ""): stream(w, n, args.steps) for n in running for w in WORKLOADS}
    for path in filter(None, args.streams.split(",")):
        name, n, msgs = recorded(path)
        work[(name, n, path)] = msgs
    warm = stream("decode", 16, 8)
    gc.collect()
    gc.freeze()  # the streams are the bench's fixture: keep them out of the collector's way
    s = Sender(args.addr, args.dev)
    runs: list[dict[str, Any]] = []
    try:
        for path in PATHS:
            s.run(path, warm, {"workload": "decode", "running": 16, "steps_arg": 8,
                               "round": 0, "check": False, "stream": ""})
        for r in range(1, args.rounds + 1):
            order = PATHS if r % 2 else PATHS[::-1]
            for (w, n, recording), msgs in work.items():
                for path in order:
                    spec = {"workload": w, "running": n, "steps_arg": args.steps, "round": r,
                            "check": args.check, "stream": recording}
                    run = summarise_run(s.run(path, msgs, spec), [k for k, _ in msgs])
                    runs.append(run)
                    print(f"vllm_link: round {r} {w}-{n} {path}: median "
                          f"{run['median_us']:,.0f} µs, p99 {run['p99_us']:,.0f} µs, "
                          f"{run['bytes_per_step']:,.0f} B/step", file=sys.stderr, flush=True)
    finally:
        s.close()
    Path(args.out).write_text(json.dumps(runs))
    return 0


# ---------------------------------------------------------------- the rank's side (B)
class _Holder:
    """Stands in for vLLM's worker (``WorkerWrapperBase``) under the rank's call loop: it
    stamps when it holds each decoded step, and (check) compares it with the original."""

    def __init__(self, expected: list[tuple[str, Any]] | None) -> None:
        self.expected = expected
        self.holds: list[int] = []
        self.found: list[str] = []

    def held(self, path: str, kind: str, obj: Any) -> None:
        self.holds.append(time.monotonic_ns())
        if self.expected is not None:
            i = len(self.holds) - 1
            want_kind, want = self.expected[i]
            if kind != want_kind:
                self.found.append(f"step {i}: {kind} instead of {want_kind}")
            self.found += [f"step {i} ({kind}): {d}" for d in compare(path, want_kind, want,
                                                                        obj)]

    def execute_model(self, scheduler_output: Any) -> None:
        self.held("ours", "execute_model", scheduler_output)

    def sample_tokens(self, grammar_output: Any) -> None:
        self.held("ours", "sample_tokens", grammar_output)


def receiver_main(args: argparse.Namespace) -> int:
    """Connect to the sender in A, then serve its runs until it says quit."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctl = ctx.socket(zmq.PAIR)
    ctl.connect(f"tcp://{args.engine}:{CTL_PORT}")
    hello = _json(ctl, "sender hello")
    public, secret = zmq.curve_keypair()
    relay_ctx = multiprocessing.get_context("spawn")
    stop, relay_stop = relay_ctx.Pipe()
    with tempfile.TemporaryDirectory(prefix="vllm-link-") as directory:
        relay = relay_ctx.Process(target=relay_main, args=(
            relay_stop, directory, hello["call"], (hello["server_key"].encode(), public,
                                                    secret)), daemon=True)
        relay.start()
        endpoint = stop.recv()  # the relay is up
        try:
            return _serve(args, ctx, ctl, hello, endpoint, directory)
        finally:
            stop.send(b"")
            relay.join(10)


def relay_main(stop: Any, directory: str, engine: str, curve: tuple[bytes, bytes, bytes],
               ) -> None:
    """The node's relay, in a process of its own, with the node's step ring (as in
    ``deltacast node``, by default)."""
    from protocol.calls import LIVENESS_S
    from protocol.ring import DEFAULT_RING_BYTES
    from worker_side.vllm.relay import Relay

    with Relay(directory, 1, 1, engine, curve, range(1), LIVENESS_S,
               ring_bytes=DEFAULT_RING_BYTES) as relay:
        stop.send(relay.endpoint)
        stop.recv()


def _serve(args: argparse.Namespace, ctx: zmq.Context[Any], ctl: zmq.Socket[bytes],
           hello: dict[str, Any], endpoint: str, directory: str) -> int:
    from vllm.distributed.device_communicators.shm_broadcast import Handle, MessageQueue

    from protocol.calls import READY
    from worker_side.vllm.channel import RankChannel
    from worker_side.vllm.proc import _Server

    spin_s = (args.spin_ms or 0.0) / 1e3  # remote ranks do not spin (SPEC §16.1 welcome)
    dealer = ctx.socket(zmq.DEALER)  # as a remote rank's (worker_main), minus the hello
    dealer.setsockopt(zmq.IDENTITY, b"0")
    dealer.connect(endpoint)
    dealer.send_multipart([READY])
    mq = MessageQueue.create_from_handle(Handle(**hello["handle"]), 0)  # a remote reader
    mq.wait_until_ready()
    key = bytes.fromhex(hello["secret"])
    while (cmd := _json(ctl, "command"))["op"] == "run":
        expected = messages(cmd) if cmd["check"] else None
        holder = _Holder(expected)
        if cmd["path"] == "ours":  # attached to the node's ring before "ready": sees call 1
            channel = RankChannel(dealer, directory, 0, ring_replies=False)
            channel.spin_s = spin_s
        ctl.send_json({"op": "ready"})
        if cmd["path"] == "ours":
            _Server(holder, channel, key, True, 0, 0).serve()  # until the QUIT call
            channel.close()
        else:
            for _ in range(cmd["n"]):
                message = mq.dequeue(timeout=WAIT_MS / 1e3)
                holder.held("vllm", message[0], message)
                ctl.send(b"")  # the answer
        ctl.send_json({"holds": holder.holds, "differences": len(holder.found),
                       "first": holder.found[:10], "checked": expected is not None,
                       "spin_ms": spin_s * 1e3})
    for s in (ctl, dealer):
        s.close(linger=0)
    return 0


# ---------------------------------------------------------------- figures
def summarise_run(run: dict[str, Any], kinds: list[str] | None = None) -> dict[str, Any]:
    """A run's figures.  A step is an ``execute_model`` message: with ``kinds`` (each
    message's), the ``sample_tokens`` messages that follow steps are not timed, and
    their bytes count in their step's."""
    lat = [(h - s) / 1e3 for s, h in zip(run.pop("starts"), run.pop("holds"), strict=True)]
    if kinds is not None:
        lat = [x for x, kind in zip(lat, kinds, strict=True) if kind == "execute_model"]
        run["steps"] = len(lat)
    run.pop("steps_arg", None)
    return {**run, "latency_us": [round(x, 1) for x in lat],
            "median_us": statistics.median(lat), "p99_us": percentile(lat, 99),
            "bytes_per_step": run["tx_bytes"] / max(1, run["steps"])}


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload: each path's medians over rounds, and the medians of the rounds'
    ratios (ours ÷ vLLM)."""
    out = []
    for w, n in dict.fromkeys((r["workload"], r["running"]) for r in runs):
        mine = [r for r in runs if (r["workload"], r["running"]) == (w, n)]
        by = {(r["round"], r["path"]): r for r in mine}
        rounds = sorted({r["round"] for r in mine})
        row: dict[str, Any] = {"workload": w, "running": n, "steps": mine[0]["steps"],
                               "rounds": len(rounds)}
        for path in PATHS:
            for k in ("median_us", "p99_us", "bytes_per_step", "first_tx_bytes"):
                row[f"{path}_{k}"] = statistics.median(by[(i, path)][k] for i in rounds)
        for k in ("median_us", "p99_us"):
            ratios = [by[(i, "ours")][k] / by[(i, "vllm")][k] for i in rounds]
            row[f"ratio_{k}"] = statistics.median(ratios)
            row[f"ratios_{k}"] = [round(x, 3) for x in ratios]
        out.append(row)
    return out


# ---------------------------------------------------------------- the two hosts
def run(running: list[int], steps: int, rounds: int, check: bool = False,
        spin_ms: float | None = None, timeout: float = 1800,
        streams: tuple[str, ...] = ()) -> dict[str, Any]:
    """The whole benchmark in fresh namespaces: the receiver in B, the sender in A;
    ``streams``, recorded object streams replayed beside the synthetic ones."""
    with netns.two_hosts("l") as (a, b), \
            tempfile.TemporaryDirectory(prefix="deltacast-link-") as tmp:
        out = Path(tmp) / "runs.json"
        spin = [] if spin_ms is None else ["--spin-ms", str(spin_ms)]
        receiver = subprocess.Popen(b.run(sys.executable, "-m", MODULE, "receiver", "--engine",
                                          a.addr, *spin), cwd=ROOT, env=ENV)
        sender = subprocess.Popen(
            a.run(sys.executable, "-m", MODULE, "sender", "--addr", a.addr, "--dev", a.dev,
                  "--running", ",".join(map(str, running)), "--steps", str(steps),
                  "--rounds", str(rounds), "--out", str(out), *(["--check"] if check else []),
                  "--streams", ",".join(str(Path(f).resolve()) for f in streams)),
            cwd=ROOT, env=ENV)
        try:
            code = sender.wait(timeout)
            receiver.wait(30)
        finally:
            for p in (sender, receiver):
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if code != 0 or not out.exists():
            raise RuntimeError(f"vllm_link: the sender failed (exit status {code})")
        runs = json.loads(out.read_text())
    return {"steps": steps, "rounds": rounds, "running": running, "link": LINK,
            "streams": [Path(f).stem for f in streams],
            "spin_ms": runs[0]["spin_ms"] if runs else spin_ms, "checked": check,
            "differences": sum(r["differences"] for r in runs), "runs": runs,
            "summary": summary(runs)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    if argv[:1] == ["receiver"]:
        p.add_argument("--engine", required=True, help="the sender's address (host A)")
        p.add_argument("--spin-ms", type=float, default=None)
        return receiver_main(p.parse_args(argv[1:]))
    if argv[:1] == ["sender"]:
        for opt in ("--addr", "--dev", "--running", "--out"):
            p.add_argument(opt, required=True)
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--rounds", type=int, required=True)
        p.add_argument("--check", action="store_true")
        p.add_argument("--streams", default="")
        return sender_main(p.parse_args(argv[1:]))
    p.add_argument("--running", default="256,4096",
                   help="synthetic streams' running requests, comma-separated (may be empty)")
    p.add_argument("--streams", default="", metavar="NAME,FILE",
                   help="also replay recorded vLLM runs: scenarios of engine_side.bench."
                        "vllm_streams (e.g. online256; recorded into out/objstreams unless "
                        "there) or object stream files (*.dcobj)")
    p.add_argument("--steps", type=int, default=1000, help="steps per stream")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--spin-ms", type=float, default=None,
                   help="our rank's spin while steps flow (default 0: DeltaExecutor's "
                        "remote ranks do not spin)")
    p.add_argument("--check", action="store_true",
                   help="compare every step the rank holds with the original")
    p.add_argument("--floor", action="store_true",
                   help="also measure the transport's floor, no deltacast code on the path "
                        "(engine_side/bench/link_floor.py)")
    p.add_argument("--json", default="", help="write the raw document here")
    p.add_argument("--figures", default="", metavar="FILE",
                   help="write the figures envelope BENCHMARKS.md is made from")
    args = p.parse_args(argv)
    reason = netns.unavailable()
    if reason:
        print(f"vllm_link: {reason}", file=sys.stderr)
        return 2
    from engine_side.bench import figures
    from engine_side.bench.page_tables import write_figures

    started = figures.stamp()
    try:
        from engine_side.bench.vllm_streams import stream_files

        streams = stream_files(filter(None, args.streams.split(",")))
    except (RuntimeError, ValueError) as exc:
        print(f"vllm_link: {exc}", file=sys.stderr)
        return 2
    doc = run([int(x) for x in args.running.split(",") if x], args.steps, args.rounds,
              args.check, args.spin_ms, streams=streams)
    if args.floor:
        from engine_side.bench import link_floor

        doc["floor"] = link_floor.run()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"], indent=1))
    for r in doc["runs"]:  # kept in --json; the figures keep each run's summary
        r.pop("latency_us", None)
    if args.figures:
        write_figures(args.figures, "vllm_link", doc, started)
    return 1 if doc["differences"] else 0


if __name__ == "__main__":
    sys.exit(main())
