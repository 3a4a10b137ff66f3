"""DeltaExecutor's ranks on other nodes, on its ROUTER (SPEC §16.1, "Ranks on other nodes").

:class:`RemoteRanks` makes the executor's ROUTER a CURVE server whose ZAP handler
admits exactly each node's key (and one made per run for the local ranks), binds node
k's port, and talks to node k's ranks through the one connection of that node's relay
(``worker_side/vllm/relay.py``): each message one frame, ``pack_relayed`` of the
rank's identity (``*``: all of the node's ranks) and its frames; a call reaches each
node once.  It checks that a relay's messages carry its node's key and come from that
node's ranks, answers the remote ranks' hellos, and reads the relays' monitor events
(:meth:`RemoteRanks.link_event`, from the executor's link watch): ZMTP heartbeats drop
a node killed, frozen or cut off within the liveness bound, its relay closes the link
when one of its ranks dies, and the drop stops the group (it restarts across hosts,
or the executor fails naming the node).  Not
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
from protocol.errors import MalformedMessage, ProtocolError
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
        self._local_key = local_public.decode()  # every local rank's ZAP User-Id
        self._node_keys = {node: key.decode() for node, key in allowed.items()}
        self._routes: dict[int, bytes] = {}  # node -> its relay's current session
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = public, secret
        self._ports = {layout.master_port + n: n for n in range(1, layout.nnodes)}
        self._joined: Counter[int] = Counter()  # connections up per node; one past the
        self._failed: Counter[int] = Counter()  # relay's (an identity taken) is no loss

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
        """One ROUTER message as ``[rank identity, *frames]``: a local rank's as it came,
        a relay's unpacked.  One that is from no rank, or whose CURVE key is not its
        rank's node's, comes back with an identity of no rank (the executor drops and
        counts it); so does one from a relay session its node has left (a hello starts
        the node's current session)."""
        parts = sock.recv_multipart(copy=False)
        ident, key = parts[0].bytes, parts[-1].get("User-Id")
        node = wire.relay_node(ident)
        if node is None:
            rank = wire.rank_of(ident, self.world_size)
            if rank is not None and (rank in self.ranks or key != self._local_key):
                return [b"key of another node:" + ident]
            return [p.bytes for p in parts]
        try:
            if not 0 < node < self.layout.nnodes or key != self._node_keys[node]:
                raise MalformedMessage("a relay of no node, or of another node's key")
            frames = [bytes(f) for f in wire.unpack_relayed(parts[1].buffer)] \
                if len(parts) == 2 else []
            rank = wire.rank_of(frames[0], self.world_size) if frames else None
            if rank is None or self.layout.node_of(rank, self.world_size) != node:
                raise MalformedMessage("a relayed message from no rank of its node")
        except ProtocolError:
            return [b"not a rank's relay:" + ident]
        if frames[1] == wire.HELLO:
            self._routes[node] = ident
        elif self._routes.get(node) != ident:
            return [b"a relay session left:" + ident]
        self.hosts[rank] = str(parts[-1].get("Peer-Address"))
        return frames

    def send(self, sock: zmq.Socket[bytes], rank: int, frames: list[Any]) -> None:
        """``frames`` to remote rank ``rank`` through its node's relay (ZMQError if
        the node has no session)."""
        route = self._routes.get(self.layout.node_of(rank, self.world_size))
        if route is None:
            raise zmq.ZMQError(zmq.EHOSTUNREACH)
        sock.send_multipart([route, wire.pack_relayed([b"%d" % rank, *frames])], copy=False)

    def broadcast(self, sock: zmq.Socket[bytes], call: list[Any]) -> None:
        """One copy of ``call`` to each node, for all of its ranks."""
        payload = wire.pack_relayed([wire.RELAY_ALL, *call])
        for route in self._routes.values():
            sock.send_multipart([route, payload], copy=False)

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
            self.send(sock, rank, [wire.REFUSED, wrong.encode()])
            raise RuntimeError(f"DeltaExecutor rank {rank} (node {fields['node']}, "
                               f"{self.hosts.get(rank, '?')}) differs from the engine: {wrong}")
        self.send(sock, rank, [wire.WELCOME, secret, settings])
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
        The connection of node k's relay (on node k's port, its CURVE handshake done)
        dropping, so that none is up, loses node k.  A second session with the relay's
        identity gets nothing through the ROUTER: its disconnect leaves the node's count
        whole, no loss.  Monitor events carry no identity, and a refused handshake also ends in
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
            if not self._joined[node]:
                return node
        return None

    def close(self) -> None:
        self.zap.stop()
        if self.layout.placement is not None:
            self.layout.placement.release()
