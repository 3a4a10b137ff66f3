"""DeltaExecutor's ranks on other nodes, on its ROUTER (SPEC §16.1, "Ranks on other nodes").

:class:`RemoteRanks` makes the executor's ROUTER a CURVE server whose ZAP handler
admits exactly each node's key (and one made per run for the local ranks), binds node
k's port, checks that every message from rank r carries r's node's key, answers the
remote ranks' hellos, and reads their connections' monitor events
(:meth:`RemoteRanks.link_event`, from the executor's link watch): ZMTP heartbeats
drop a rank killed, frozen or cut off within the liveness bound, and the drop stops
the group (it restarts across hosts, or the executor fails naming the node).  Not
thread-safe but for ``link_event``, which only the link watch calls.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import zmq

from engine_side.vllm.nodes import LayoutError, NodeLayout, hello_mismatch
from engine_side.zap import ZapHandler
from protocol import calls as wire
from protocol.errors import ProtocolError
from protocol.faults import PeerFaults

log = logging.getLogger("deltacast.vllm.executor")


def layout_for(extra: dict[str, Any], world_size: int) -> NodeLayout:
    """The node layout ``additional_config`` asks for: ``deltacast_placement: "ray"``
    (Ray places the ranks), else the ``deltacast_nnodes`` options (or one node)."""
    placement = extra.get("deltacast_placement")
    if placement == "ray":
        from engine_side.vllm.ray_nodes import place

        return place(extra, world_size)
    if placement is not None:
        raise LayoutError(f"deltacast_placement must be \"ray\" (or unset: nodes started "
                          f"with `deltacast node`), got {placement!r}")
    return NodeLayout.from_config(extra, world_size)


class RemoteRanks:
    """See the module docstring; ``layout`` has more than one node."""

    def __init__(self, layout: NodeLayout, world_size: int, ctx: zmq.Context[Any],
                 sock: zmq.Socket[bytes]) -> None:
        self.layout, self.world_size = layout, world_size
        self.ranks = range(layout.per_node(world_size), world_size)
        self.hosts: dict[int, str] = {}  # rank -> its peer address (its first message)
        self.config_hash = ""
        public, secret, allowed = layout.node_keys()
        local_public, local_secret = zmq.curve_keypair()
        #: what the local ranks connect with: (the engine's key, theirs, their secret)
        self.local_curve = (public, local_public, local_secret)
        self.zap = ZapHandler(ctx, frozenset([*allowed.values(), local_public]))
        self.keys = {rank: (local_public if node == 0 else allowed[node]).decode()
                     for rank in range(world_size)
                     for node in [layout.node_of(rank, world_size)]}
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret
        self._ports = {layout.master_port + n: n for n in range(1, layout.nnodes)}
        self._joined: Counter[int] = Counter()  # connections up per node; one past its
        self._failed: Counter[int] = Counter()  # ranks (an identity taken: dropped) is no loss

    def bind(self, sock: zmq.Socket[bytes], vllm_config: Any) -> None:
        """Listen for each node's ranks (placed by Ray: then start them)."""
        for node in range(1, self.layout.nnodes):
            where = self.layout.channel(node)
            try:
                sock.bind(where)
            except zmq.ZMQError as exc:
                raise RuntimeError(f"DeltaExecutor cannot listen on {where} for node {node}'s "
                                   f"ranks ({exc}): deltacast_master_addr must be this host's "
                                   "address and the port free") from exc
            log.info("DeltaExecutor: node %d's ranks join at %s", node, where)
        if self.layout.placement is not None:
            self.layout.placement.launch(vllm_config, self.layout)

    def recv(self, sock: zmq.Socket[bytes]) -> list[bytes]:
        """One ROUTER message; one whose CURVE key is not its rank's node's comes back
        with an identity of no rank (the executor drops and counts it)."""
        parts = sock.recv_multipart(copy=False)
        ident = parts[0].bytes
        rank = wire.rank_of(ident, self.world_size)
        if rank is not None and parts[-1].get("User-Id") != self.keys[rank]:
            return [b"key of another node:" + ident, *(p.bytes for p in parts[1:])]
        if rank is not None and rank not in self.hosts and rank in self.ranks:
            self.hosts[rank] = str(parts[-1].get("Peer-Address"))
        return [p.bytes for p in parts]

    def welcome(self, sock: zmq.Socket[bytes], rank: int, frames: list[bytes], vllm_config: Any,
                secret: bytes, settings: bytes, faults: PeerFaults) -> None:
        """A remote rank's hello: the secret and its settings if it built what we built;
        else refused, and RuntimeError naming what differs (start-up fails)."""
        node = self.layout.node_of(rank, self.world_size)
        try:
            fields = wire.parse_hello(frames[0] if len(frames) == 1 else b"")
        except ProtocolError as exc:
            faults.hit(f"rank {rank}", exc)
            return
        if not self.config_hash:  # at the first hello: the config as the nodes build it
            self.config_hash = vllm_config.compute_hash()  # (a restart's scheduler hook
        wrong = hello_mismatch(fields, node, self.config_hash)  # is not theirs)
        if wrong is not None:
            sock.send_multipart([b"%d" % rank, wire.REFUSED, wrong.encode()])
            raise RuntimeError(f"DeltaExecutor rank {rank} (node {fields['node']}, "
                               f"{self.hosts.get(rank, '?')}) differs from the engine: {wrong}")
        sock.send_multipart([b"%d" % rank, wire.WELCOME, secret, settings])
        log.info("DeltaExecutor: rank %d joined from node %d at %s", rank, node,
                 self.hosts.get(rank, "?"))

    def waiting_for(self) -> str:
        return ", ".join(self.layout.channel(n) for n in range(1, self.layout.nnodes))

    def describe(self, node: int) -> str:
        ranks = [r for r in self.ranks if self.layout.node_of(r, self.world_size) == node]
        hosts = sorted({self.hosts.get(r, "?") for r in ranks})
        return f"node {node} (ranks {ranks}, host {', '.join(hosts)})"

    def link_event(self, kind: int, endpoint: str) -> int | None:
        """One monitor event on a tcp endpoint: the node lost, if this event loses one.
        A connection on node k's port that completed its CURVE handshake dropping, so
        that fewer than its ranks' are up, loses node k.  A second session with a rank's
        identity is dropped by the ROUTER: its disconnect leaves the node's count whole,
        no loss.  Monitor events carry no identity, and a refused handshake also ends in
        a disconnect: each failed handshake on a port accounts for that port's next
        disconnect (a node dropping at the very moment a stranger's handshake fails
        there is then missed, never a false failure)."""
        node = self._ports.get(int(endpoint.rpartition(":")[2] or 0))
        if node is None or kind == zmq.EVENT_ACCEPTED:
            return None
        if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._joined[node] += 1
        elif kind != zmq.EVENT_DISCONNECTED:  # a failed handshake
            self._failed[node] += 1
        elif self._failed[node]:
            self._failed[node] -= 1
        elif self._joined[node]:
            self._joined[node] -= 1
            if self._joined[node] < self.layout.per_node(self.world_size):
                return node
        return None

    def close(self) -> None:
        self.zap.stop()
        if self.layout.placement is not None:
            self.layout.placement.release()
