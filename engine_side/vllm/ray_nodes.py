"""DeltaExecutor's ranks placed by Ray (``additional_config={"deltacast_placement": "ray"}``).

Ray places and launches; it carries no step.  The executor (a Ray driver: it joins the
cluster at ``deltacast_ray_address``, else ``RAY_ADDRESS``, else ``auto``) reserves a
placement group of one bundle per rank (``{"CPU": deltacast_ray_cpus}``, default 1,
strategy ``deltacast_ray_strategy``, default PACK) and reads where Ray put them: the
engine's node is node 0 (it must hold bundles: its ranks share the step ring), the other
nodes follow, each running as many ranks (else :class:`LayoutError`).  On each other
node one actor (``worker_side.vllm.ray_node.RayNode``, named by module: the engine never
imports the worker side) makes that node's CURVE key pair and hands back only the public
key, which goes on the ZAP allow-list; the actor then starts the node's ranks, which join
the executor's channel like ``deltacast node``'s (SPEC §16.1).  What crosses Ray: the
vLLM config and public keys; the seal's secret travels only over CURVE, after the hello.

Ports: torch.distributed and the channel take ``nnodes`` consecutive free ports on the
engine's Ray address (``deltacast_master_port`` fixes the first).  Released (actors
killed, the group removed) when the executor shuts down; if the engine's process dies,
Ray ends its actors, and the ranks see the engine gone.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from collections import Counter
from typing import Any

import zmq

from engine_side.vllm.nodes import LayoutError, NodeLayout

log = logging.getLogger("deltacast.vllm.executor")
PLACE_S = 60.0  # the placement group must be placed within this long
RUN_END_S = 5.0  # at release, what a node whose ranks quit gets to return
ACTOR = ("worker_side.vllm.ray_node", "RayNode")


def free_ports(addr: str, count: int) -> int:
    """The first of ``count`` consecutive ports free on ``addr`` (checked, not held)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((addr, 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        try:
            held = []
            for port in range(first, first + count):
                s = socket.socket()
                held.append(s)
                s.bind((addr, port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise LayoutError(f"no {count} consecutive free ports on {addr}")


class RayNodes:
    """The placement group and the other nodes' actors (see the module docstring)."""

    def __init__(self, extra: dict[str, Any], world_size: int) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, placement_group_table
        except ImportError as exc:
            raise LayoutError("deltacast_placement=\"ray\" needs Ray: pip install "
                              "'deltacast[ray]'") from exc
        if not ray.is_initialized():
            address = extra.get("deltacast_ray_address") or os.environ.get("RAY_ADDRESS") or "auto"
            try:
                ray.init(address=address, log_to_driver=True)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise LayoutError(f"DeltaExecutor cannot join the Ray cluster at {address!r} "
                                  f"({exc}): start it with `ray start --head` or set "
                                  "deltacast_ray_address") from exc
        cpus = float(extra.get("deltacast_ray_cpus", 1))
        strategy = str(extra.get("deltacast_ray_strategy", "PACK"))
        self.group = placement_group([{"CPU": cpus}] * world_size, strategy=strategy)
        self.actors: list[Any] = []
        self.runs: list[Any] = []  # each actor's RayNode.run (its node's exit code)
        if not self.group.wait(timeout_seconds=PLACE_S):
            self.release()
            raise LayoutError(f"Ray could not place {world_size} bundles of {cpus:g} CPU "
                              f"({strategy}) within {PLACE_S:.0f} s: `ray status` shows what "
                              "the cluster has")
        where: dict[int, str] = placement_group_table(self.group)["bundles_to_node_id"]
        here = ray.get_runtime_context().get_node_id()
        per_node = Counter(where.values())
        addrs = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        if here not in per_node or len(set(per_node.values())) != 1:
            self.release()
            raise LayoutError(
                f"Ray placed the {world_size} ranks as {dict(per_node)} (node id: ranks) "
                f"and the engine runs on {here}: DeltaExecutor needs the engine's node to hold "
                "ranks and every node as many (set deltacast_ray_strategy or the nodes' CPUs)")
        order = sorted(per_node, key=lambda n: (n != here, n))  # the engine's node first
        self.nodes = [(min(b for b, n in where.items() if n == node), addrs[node])
                      for node in order]  # (the node's first bundle, its address)
        self.master_addr = addrs[here]

    def layout(self, extra: dict[str, Any]) -> NodeLayout:
        """The node layout, the other nodes' public keys got from their actors."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        nnodes = len(self.nodes)
        if nnodes == 1:
            log.info("DeltaExecutor: Ray placed every rank on the engine's node")
            self.release()
            return NodeLayout()
        cls = ray.remote(getattr(importlib.import_module(ACTOR[0]), ACTOR[1]))
        cpus = self.group.bundle_specs[0]["CPU"]
        for bundle, _ in self.nodes[1:]:
            strategy = PlacementGroupSchedulingStrategy(self.group, bundle)
            self.actors.append(cls.options(num_cpus=cpus, scheduling_strategy=strategy,
                                           max_concurrency=2).remote())
        public, secret = zmq.curve_keypair()
        keys = ray.get([a.public_key.remote() for a in self.actors], timeout=PLACE_S)
        port = int(extra.get("deltacast_master_port") or free_ports(self.master_addr, nnodes))
        self._gloo(self.master_addr)
        return NodeLayout(nnodes, self.master_addr, port, None, placement=self,
                          curve=(public, secret, dict(enumerate(keys, start=1))))

    @staticmethod
    def _gloo(addr: str) -> None:
        """The engine's ranks speak gloo on the interface holding its Ray address."""
        import psutil

        if os.environ.get("GLOO_SOCKET_IFNAME"):
            return
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == addr for a in addrs):
                os.environ["GLOO_SOCKET_IFNAME"] = name
                log.info("DeltaExecutor: gloo uses %s (holds %s)", name, addr)

    def launch(self, config: Any, layout: NodeLayout) -> None:
        """Each other node's actor starts its ranks (they join the channel)."""
        assert layout.curve is not None
        for k, (actor, (_, addr)) in enumerate(zip(self.actors, self.nodes[1:],
                                                      strict=True), start=1):
            self.runs.append(actor.run.remote(  # its exit: the link watch sees it
                config, k, layout.nnodes, layout.master_addr, layout.master_port,
                layout.curve[0], addr))
            log.info("DeltaExecutor: node %d's ranks start on Ray node %s", k, addr)

    def release(self) -> None:
        """Kill the actors (their ranks exit with them) and remove the group; first, up
        to RUN_END_S, let the nodes whose ranks have quit return (removing their private
        directories: an actor killed after its ranks exited leaves its directory)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=RUN_END_S)
            self.runs = []
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        remove_placement_group(self.group)


def place(extra: dict[str, Any], world_size: int) -> NodeLayout:
    return RayNodes(extra, world_size).layout(extra)
