"""One Ray node's DeltaExecutor ranks: the actor the executor places in its placement group.

Ray only places and launches (``engine_side/vllm/ray_nodes.py``): the actor makes this
node's CURVE key pair here (its secret never leaves the node; the engine learns the public
key from :meth:`RayNode.public_key`), then :meth:`RayNode.run` starts the node's ranks as
``deltacast node`` does (:func:`worker_side.vllm.node.start_node`); they join the engine
over the CURVE channel, where the seal's secret reaches them after the hello.  Killing the
actor (the engine's shutdown, or the engine's Ray job ending) ends its ranks with it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import zmq


def interface_of(addr: str) -> str | None:
    """The network interface holding ``addr`` on this host (None: none does)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            return name
    return None


class RayNode:
    """A Ray actor (the engine wraps it with ``ray.remote``): one node's ranks."""

    def __init__(self) -> None:
        self._public, self._secret = zmq.curve_keypair()

    def public_key(self) -> bytes:
        return self._public

    def run(self, config: Any, node: int, nnodes: int, master_addr: str, master_port: int,
            engine_key: bytes, node_addr: str) -> int:
        """Start this node's ranks and supervise them: the node's exit code (0 when the
        engine stopped them).  gloo is pointed at the interface holding ``node_addr``
        (this node's address in the Ray cluster) unless GLOO_SOCKET_IFNAME is set."""
        from worker_side.vllm.node import start_node

        if not os.environ.get("GLOO_SOCKET_IFNAME"):
            nic = interface_of(node_addr)
            if nic is None:
                print(f"deltacast node {node}: no interface holds this node's Ray address "
                      f"{node_addr}; set GLOO_SOCKET_IFNAME", file=sys.stderr, flush=True)
                return 1
            os.environ["GLOO_SOCKET_IFNAME"] = nic
        return start_node(config, node, nnodes, master_addr, master_port,
                          (engine_key, self._public, self._secret))
