"""The transport's floor across two hosts: step latency with no deltacast code on the path.

::

    .venv/bin/python -m engine_side.bench.link_floor [--steps 2000] [--rounds 2]

In the two namespaces of :mod:`engine_side.bench.netns`, an engine in A sends a 200-byte
message, in lockstep (the next leaves once the reader has answered), to a reader in B
over three paths:

* ``plain``: one plain TCP hop, ROUTER → DEALER (what vLLM's remote reader has);
* ``curve``: the same hop with CURVE;
* ``relayed``: CURVE to a relay process, which writes the node's ring and rings the
  reader's doorbell (:class:`protocol.ring.OwnedRing`; the reader,
  :class:`worker_side.ring.RingReader`, sleeps on the doorbell): the topology a
  DeltaExecutor node has, without the calls, encoding or decoding that ride on it.

Latency = when the reader holds the message − when the engine started sending it, on
the machine's one monotonic clock.  :func:`run` is what ``vllm_link --floor`` adds to
its document.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from engine_side.bench import netns
from engine_side.bench.vllm_scenarios import percentile

ROOT = Path(__file__).resolve().parents[2]
MODULE = "engine_side.bench.link_floor"
PORT = 29631
MODES = ("plain", "curve", "relayed")
MESSAGE = b"x" * 200
QUIT = b"Q"
WAIT_MS = 60_000
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    if not sock.poll(WAIT_MS):
        raise TimeoutError(f"link_floor: nothing in {WAIT_MS / 1e3:.0f} s")
    return sock.recv_multipart()


def engine(addr: str, mode: str, keys: tuple[bytes, bytes], steps: int) -> list[float]:
    """A's side: ``steps`` lockstep messages; the latencies (µs) the reader reports."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    if mode != "plain":
        router.curve_server = True
        router.curve_publickey, router.curve_secretkey = keys
    router.bind(f"tcp://{addr}:{PORT}")
    who = _recv(router)[0]  # the reader's (or its relay's) hello
    starts = []
    for _ in range(steps):
        starts.append(time.monotonic_ns())
        router.send_multipart([who, MESSAGE])
        _recv(router)
    router.send_multipart([who, QUIT])
    holds = json.loads(_recv(router)[1])
    router.close(linger=0)
    return [(h - s) / 1e3 for s, h in zip(starts, holds, strict=True)]


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], addr: str, mode: str,
            server_key: bytes) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    if mode != "plain":
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(f"tcp://{addr}:{PORT}")
    return sock


def reader(addr: str, mode: str, server_key: bytes) -> None:
    """B's side: hold each message (stamp), answer; report the stamps on QUIT."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    if mode == "relayed":
        return _relayed_reader(ctx, addr, server_key)
    sock = _dealer(ctx, addr, mode, server_key)
    sock.send(b"H")
    holds: list[int] = []
    while _recv(sock)[0] != QUIT:
        holds.append(time.monotonic_ns())
        sock.send(b"K")
    sock.send(json.dumps(holds).encode())
    sock.close(linger=1000)


def _relay(directory: str, addr: str, server_key: bytes) -> None:
    """The node's relay: the engine's messages into the ring (doorbell rung), the
    reader's answers (on an ipc PAIR) back up."""
    from protocol.ring import MIN_BYTES, OwnedRing

    ring = OwnedRing(Path(directory), 1 << 20, MIN_BYTES)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    up = _dealer(ctx, addr, "curve", server_key)
    down = ctx.socket(zmq.PAIR)
    down.bind(f"ipc://{directory}/answers")
    _recv(down)  # the reader is attached to the ring: the engine may start
    up.send(b"H")
    poller = zmq.Poller()
    poller.register(up, zmq.POLLIN)
    poller.register(down, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(WAIT_MS))
        if not ready:
            raise TimeoutError("link_floor: the relay heard nothing")
        if up in ready:
            message = up.recv()
            ring.publish([message], 0)
            ring.wake()
        if down in ready:
            answer = down.recv()
            up.send(answer)
            if answer not in (b"K",):  # the reader's report: done
                break
    for sock in (up, down):
        sock.close(linger=1000)
    ring.close()


def _relayed_reader(ctx: zmq.Context[zmq.Socket[bytes]], addr: str, server_key: bytes) -> None:
    from protocol.ring import drain_bell, open_bell, unpack_frames
    from worker_side.ring import RingReader

    with tempfile.TemporaryDirectory(prefix="link-floor-") as directory:
        bell = open_bell(Path(directory), 0)
        relay = multiprocessing.get_context("spawn").Process(
            target=_relay, args=(directory, addr, server_key), daemon=True)
        relay.start()
        while not (Path(directory) / "ring").exists():
            time.sleep(0.01)
        ring = RingReader(Path(directory), 0)
        answers = ctx.socket(zmq.PAIR)
        answers.connect(f"ipc://{directory}/answers")
        answers.send(b"R")
        poller = zmq.Poller()
        poller.register(bell, zmq.POLLIN)
        holds: list[int] = []
        while True:
            records = ring.read()
            if not records:  # announce that we sleep, then sleep on the doorbell
                if not ring.sleep(True) and poller.poll(WAIT_MS):
                    drain_bell(bell)
                ring.sleep(False)
                continue
            for _, payload in records:
                if bytes(unpack_frames(payload)[0]) == QUIT:
                    answers.send(json.dumps(holds).encode())
                    relay.join(30)
                    ring.close()
                    os.close(bell)
                    return
                holds.append(time.monotonic_ns())
                answers.send(b"K")


def run(steps: int = 2000, rounds: int = 2) -> dict[str, Any]:
    """Every mode, ``rounds`` times in turn, in fresh namespaces: per mode the medians
    over rounds of each run's median and p99 (µs), a run's first tenth (at most 100
    steps) left out as its warm-up."""
    if steps < 10 or rounds < 1:
        raise ValueError("link_floor: at least 10 steps and 1 round")
    public, secret = zmq.curve_keypair()
    runs: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    with netns.two_hosts("f") as (a, b):
        for _ in range(rounds):
            for mode in MODES:
                rdr = subprocess.Popen(b.run(sys.executable, "-m", MODULE, "reader", a.addr, mode,
                                             public.decode()), cwd=ROOT, env=ENV)
                try:
                    out = subprocess.run(
                        a.run(sys.executable, "-m", MODULE, "engine", a.addr, mode,
                              public.decode(), secret.decode(), str(steps)),
                        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
                    if out.returncode != 0:
                        raise RuntimeError(f"link_floor: the {mode} engine failed:\n"
                                           f"{out.stderr[-2000:]}")
                    rdr.wait(60)
                finally:
                    if rdr.poll() is None:
                        rdr.kill()
                        rdr.wait()
                lat = json.loads(out.stdout)[min(100, steps // 10):]
                runs[mode].append((statistics.median(lat), percentile(lat, 99)))
    return {"steps": steps, "rounds": rounds, "bytes": len(MESSAGE),
            "modes": {m: {"median_us": statistics.median(r[0] for r in runs[m]),
                          "p99_us": statistics.median(r[1] for r in runs[m]),
                          "medians_us": [round(r[0], 1) for r in runs[m]]} for m in MODES}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["engine"]:
        addr, mode, public, secret, steps = argv[1:6]
        lat = engine(addr, mode, (public.encode(), secret.encode()), int(steps))
        print(json.dumps(lat))
        return 0
    if argv[:1] == ["reader"]:
        addr, mode, public = argv[1:4]
        reader(addr, mode, public.encode())
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    reason = netns.unavailable()
    if reason or args.steps < 10 or args.rounds < 1:
        print(f"link_floor: {reason or 'at least 10 steps and 1 round'}", file=sys.stderr)
        return 2
    print(json.dumps(run(args.steps, args.rounds), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
