"""``deltacast node``: one other host's DeltaExecutor ranks (vLLM's ``--headless`` node).

The engine's host is node 0 (``additional_config`` names the layout: see
``engine_side/vllm/nodes.py``); on node K, ``deltacast node --nnodes N --node-rank K
--master-addr ADDR --master-port PORT --keys DIR VLLM-ARGS...`` builds the same vLLM
config from the same vLLM arguments, starts ranks ``K*W/N .. (K+1)*W/N - 1`` (W the
world size), and they join the engine through the node's relay
(:mod:`worker_side.vllm.relay`: one connection to ``tcp://ADDR:PORT+K`` over CURVE with
this node's key, ``workerK.key_secret`` in DIR, the engine's ``engine.key`` beside it;
one per generation of ranks), which writes each call once into the node's step ring
(``deltacast_ring_kb`` of the config, as on the engine's host; 0: over ipc).
torch.distributed meets at ``tcp://ADDR:PORT``; gloo picks its interface from
``GLOO_SOCKET_IFNAME`` when set (printed at start).  The model's weights must be at
the same path on every node.

The node exits 0 when the engine stops its ranks, 1 (one line naming the rank) when a
rank fails to start, loses the engine or is refused, 128+N on a signal; its ranks never
outlive it. When the engine restarts the group (a rank died, here or on another host)
the node starts its ranks again: a rank that the engine told to (status RESTART_EXIT),
or one that died otherwise (killed, crashed: the relay closes, the engine sees this
node's link drop and restarts the group), stops this node's others, and the node
starts them all anew (a new relay session); so does a rank that has not exited JOIN_S
after the relay passed on the engine's restart (hung in a step, it never reads it).
They must be welcomed within REJOIN_S (the relay must reach the engine within 30 s),
else they exit 1 and so does the node. A
rank frozen here is killed past the liveness bound (:mod:`worker_side.vllm.rank_watch`),
and so is started again. With
``deltacast_restarts`` 0 in the config, a rank's death ends the node (status 1), as it
ends the engine.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol.calls import LIVENESS_S
from protocol.cli_support import (
    EXIT_FAILED,
    EXIT_NO_INPUT,
    EXIT_USAGE,
    CliError,
    int_in,
)
from protocol.ring import DEFAULT_RING_BYTES
from protocol.stale_dirs import sweep_stale_dirs
from worker_side.vllm.rank_watch import RankWatch
from worker_side.vllm.relay import Relay

JOIN_S = 10.0  # ranks given to stop after one failed, or after the engine's restart
_SUPERVISE_S = 0.5  # how often the supervision looks at what the relay was told
REJOIN_S = 120.0  # ranks started again after a restart must be welcomed within this long


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nnodes", type=int_in(2), required=True,
                        help="nodes in all, the engine's included (vLLM's --nnodes)")
    parser.add_argument("--node-rank", type=int_in(1), required=True,
                        help="this node's number, 1 .. nnodes-1 (vLLM's --node-rank)")
    parser.add_argument("--master-addr", required=True,
                        help="the engine host's address (vLLM's --master-addr)")
    parser.add_argument("--master-port", type=int_in(1, 65000), required=True,
                        help="torch.distributed's port on the engine host; the executor "
                             "listens for node K on PORT+K (vLLM's --master-port)")
    parser.add_argument("--keys", type=Path, required=True, metavar="DIR",
                        help="engine.key and this node's workerK.key_secret (deltacast keys)")
    parser.add_argument("--engine", choices=("serve", "llm"), default="serve",
                        help="how the engine was started: `vllm serve` or Python's LLM "
                             "class (their defaults differ, and so would the config)")
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="VLLM-ARGS",
                        help="the engine's vLLM arguments: MODEL (or --model) and the rest")


def _keys(directory: Path, node: int) -> tuple[bytes, bytes, bytes]:
    import zmq.auth

    engine, own = directory / "engine.key", directory / f"worker{node}.key_secret"
    for path in (engine, own):
        if not path.is_file():
            raise CliError(f"{path}: no such key file (copy the engine's engine.key and this "
                           f"node's worker{node}.key_secret from `deltacast keys`)",
                           EXIT_NO_INPUT)
    public, secret = zmq.auth.load_certificate(str(own))
    if secret is None:
        raise CliError(f"{own} holds no secret key", EXIT_NO_INPUT)
    return zmq.auth.load_certificate(str(engine))[0], public, secret


def build_config(vllm_args: list[str], engine: str) -> Any:
    """The VllmConfig the engine built from the same arguments."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = list(vllm_args)
    if args and args[0] == "--":
        args = args[1:]
    if args and not args[0].startswith("-"):
        args = ["--model", *args]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser(prog="deltacast node"))
    try:
        parsed = parser.parse_args(args)
    except SystemExit as exc:
        raise CliError("the vLLM arguments above are not valid", EXIT_USAGE) from exc
    context = UsageContext.OPENAI_API_SERVER if engine == "serve" else UsageContext.LLM_CLASS
    engine_args = EngineArgs.from_cli_args(parsed)
    backend = engine_args.distributed_executor_backend
    if isinstance(backend, str) and "." in backend:  # a class by name, as the class: vLLM
        from vllm.utils.import_utils import resolve_obj_by_qualname  # allows PP only to a

        engine_args.distributed_executor_backend = resolve_obj_by_qualname(backend)  # class
    return engine_args.create_engine_config(usage_context=context)


def run(args: argparse.Namespace) -> int:
    node, nnodes = args.node_rank, args.nnodes
    if node >= nnodes:
        raise CliError(f"--node-rank {node} must be below --nnodes {nnodes} (node 0 is the "
                       "engine's)", EXIT_USAGE)
    curve = _keys(args.keys, node)
    config = build_config(args.vllm_args, args.engine)
    world = config.parallel_config.world_size
    if world % nnodes:
        raise CliError(f"--nnodes {nnodes} does not divide the world size {world}", EXIT_USAGE)
    return start_node(config, node, nnodes, args.master_addr, args.master_port, curve)


def start_node(config: Any, node: int, nnodes: int, master_addr: str, master_port: int,
               curve: tuple[bytes, bytes, bytes]) -> int:
    """Start node ``node``'s ranks and supervise them (the exit code: see the module
    docstring); ``curve``: (the engine's public key, this node's public and secret)."""
    from vllm.v1.executor.multiproc_executor import set_multiprocessing_worker_envs

    parallel = config.parallel_config
    world = parallel.world_size
    per_node = world // nnodes
    ranks = range(node * per_node, (node + 1) * per_node)
    tp = parallel.tensor_parallel_size
    output_rank = world - tp * parallel.prefill_context_parallel_size
    endpoint = f"tcp://{master_addr}:{master_port + node}"
    # a distinct address per node: vLLM's CPU ranks share memory only with the same one
    init_method = f"tcp://{master_addr}:{master_port}?node={node}"
    print(f"deltacast node {node}: ranks {list(ranks)} of {world} on {socket.gethostname()}; "
          f"engine {endpoint}; torch.distributed tcp://{master_addr}:{master_port}, "
          f"gloo interface {os.environ.get('GLOO_SOCKET_IFNAME') or '(gloo chooses)'}",
          file=sys.stderr, flush=True)
    for left in sweep_stale_dirs():  # (what killed nodes and engines left on this host)
        print(f"deltacast node {node}: removed {left} (its owner is dead)", file=sys.stderr,
              flush=True)
    set_multiprocessing_worker_envs(per_node)
    common = dict(init_method=init_method, secret=b"", output_rank=output_rank, node=node)
    extra = config.additional_config if isinstance(config.additional_config, dict) else {}
    restarts = int(extra.get("deltacast_restarts", 1)) > 0  # 0: the engine fails instead
    liveness_s = float(extra.get("deltacast_liveness_s", LIVENESS_S))
    # the node's step ring, sized as the engine's
    ring_bytes = int(extra.get("deltacast_ring_kb", DEFAULT_RING_BYTES >> 10)) << 10
    watch = RankWatch(node, liveness_s)
    rejoin_s, generation = 0.0, 0
    try:
        while True:
            generation += 1
            relay = Relay(watch.directory, node, generation, endpoint, curve, ranks,
                          liveness_s, restarted=bool(rejoin_s), ring_bytes=ring_bytes)
            with relay:
                status = _generation(config, ranks, tp, {
                    **common, "rejoin_s": rejoin_s, "endpoint": relay.endpoint,
                    "ring_dir": watch.directory if ring_bytes else None}, watch, relay)
            print(f"deltacast node {node}: relayed {relay.relayed} messages from the engine; "
                  f"calls to every rank: {relay.ring_calls} through the node's ring, "
                  f"{relay.socket_calls} on ipc", file=sys.stderr, flush=True)
            if status != RESTART:
                return status
            if not restarts:
                return EXIT_FAILED
            print(f"deltacast node {node}: its group restarts; starting ranks {list(ranks)} "
                  "again", file=sys.stderr, flush=True)
            rejoin_s = REJOIN_S
    finally:
        watch.close()


RESTART = -1  # _supervise: start the ranks again


def _generation(config: Any, ranks: range, tp: int, common: dict[str, Any],
                watch: RankWatch, relay: Relay) -> int:
    """Start ``ranks`` and supervise them until one exits: the node's exit code, or
    RESTART.  Their processes are gone when it returns; ``watch`` kills a frozen one;
    ``relay`` is closed as soon as one exits (the engine sees this node's link drop)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    from worker_side.vllm.proc import worker_main

    ctx = multiprocessing.get_context("spawn")
    lock = ctx.Lock()
    view = copy.copy(config)  # vLLM binds each of a host's ranks to an entry of its OMP
    view.parallel_config = copy.copy(config.parallel_config)  # list: this host's ranks
    view.parallel_config.world_size = len(ranks)  # (vLLM's nnodes is 1: ours is ours)
    omp = OMPProcessManager(view)
    procs, deaths = [], []
    ends = watch.endpoints(ranks)
    try:
        for local, rank in enumerate(ranks):
            reader, writer = ctx.Pipe(duplex=False)
            kwargs = dict(vllm_config=config, local_rank=local, rank=rank,
                          is_driver=rank % tp == 0, lock=lock, death=reader,
                          watch=ends[rank], **common)
            p = ctx.Process(target=worker_main, kwargs=kwargs, name=f"DeltaWorker-{rank}",
                            daemon=True)
            with omp.configure_omp_envs(rank=rank, local_rank=local):
                p.start()
            watch.watch(ends[rank], rank, p)
            reader.close()
            procs.append(p)
            deaths.append(writer)
        return _supervise(procs, list(ranks), lambda: relay.told_restart)
    finally:
        relay.close()
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(JOIN_S)
            if p.is_alive():
                p.kill()
                p.join()
        for w in deaths:
            w.close()


def _supervise(procs: list[Any], ranks: list[int],
               told_restart: Callable[[], float | None]) -> int:
    """Until every rank has exited: 0 if all did cleanly; RESTART when one was told to
    restart or died of a signal or a crash, or when one has not exited JOIN_S after the
    engine told them all to restart (``told_restart``: when; a rank hung in a step, whose
    group the engine stopped, never reads it); else EXIT_FAILED (named)."""
    from protocol.calls import RESTART_EXIT

    left = {p.sentinel: (rank, p) for rank, p in zip(ranks, procs, strict=True)}
    while left:
        told = told_restart()
        if told is not None and time.monotonic() - told > JOIN_S:
            print(f"deltacast node: rank(s) {sorted(r for r, _ in left.values())} did not "
                  f"exit {JOIN_S:g} s after the engine restarted the group (hung in a "
                  "step); stopping them", file=sys.stderr, flush=True)
            return RESTART
        for sentinel in multiprocessing.connection.wait(list(left), _SUPERVISE_S):
            rank, p = left.pop(sentinel)  # type: ignore[call-overload]
            p.join()
            if p.exitcode == 0:
                continue
            restart = p.exitcode != EXIT_FAILED  # 1: refused, failed, engine lost
            print(f"deltacast node: rank {rank} exited with code {p.exitcode}"
                  f"{' (its group restarts)' if p.exitcode == RESTART_EXIT else ''}; "
                  f"stopping this node's other ranks", file=sys.stderr, flush=True)
            return RESTART if restart else EXIT_FAILED
    return 0
