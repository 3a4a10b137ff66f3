"""Where DeltaExecutor's ranks run: the node layout, and the engine's CURVE identity.

vLLM refuses ``nnodes > 1`` for an executor class, so the layout comes through
``additional_config`` under vLLM's own flag names: ``deltacast_nnodes``,
``deltacast_master_addr``, ``deltacast_master_port`` (``--nnodes``, ``--master-addr``,
``--master-port``), plus ``deltacast_keys``, a directory written by ``deltacast keys DIR
--workers N`` (N ≥ nnodes - 1).  The engine is node 0 and runs ranks
``0 .. world_size/nnodes - 1``; node k (``deltacast node --node-rank k``, the same
vLLM arguments) runs the next ``world_size/nnodes`` ranks.

Ports: torch.distributed's TCP store listens on ``master_port`` (as vLLM's); node k's
ranks reach the executor's channel (one ROUTER with CURVE: only the keys ``worker1 ..
worker{nnodes-1}`` get in, node k's ranks only with ``worker{k}``'s key) on
``master_port + k``, so a dropped connection names its node.

With ``deltacast_placement: "ray"`` Ray places the ranks and makes the layout instead
(:func:`engine_side.vllm.remote.layout_for`, :mod:`engine_side.vllm.ray_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


class LayoutError(ValueError):
    """The node layout in additional_config cannot work (the message says why)."""


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int = 1
    master_addr: str = ""
    master_port: int = 0
    keys: Path | None = None
    placement: Any = None  # Ray's placement (engine_side.vllm.ray_nodes), if it placed us
    curve: tuple[bytes, bytes, dict[int, bytes]] | None = None  # keys made for this run

    @staticmethod
    def from_config(extra: dict[str, Any], world_size: int) -> NodeLayout:
        nnodes = extra.get("deltacast_nnodes", 1)
        if not isinstance(nnodes, int) or nnodes < 1:
            raise LayoutError(f"deltacast_nnodes must be a positive integer, got {nnodes!r}")
        if nnodes == 1:
            return NodeLayout()
        if world_size % nnodes:
            raise LayoutError(f"deltacast_nnodes={nnodes} does not divide the world size "
                              f"{world_size} (tensor x pipeline parallel): every node runs "
                              "as many ranks")
        addr, port = extra.get("deltacast_master_addr"), extra.get("deltacast_master_port")
        if not isinstance(addr, str) or not addr:
            raise LayoutError("deltacast_nnodes > 1 needs deltacast_master_addr: the engine "
                              "host's address the other nodes reach")
        if not isinstance(port, int) or not 1 <= port <= 65535 - nnodes:
            raise LayoutError(f"deltacast_master_port must be a port in 1..{65535 - nnodes} "
                              f"(the channel uses the next {nnodes - 1}), got {port!r}")
        keys = extra.get("deltacast_keys")
        if not isinstance(keys, str) or not Path(keys, "engine.key_secret").is_file():
            raise LayoutError(f"deltacast_keys={keys!r} must name a directory written by "
                              f"`deltacast keys DIR --workers {nnodes - 1}` (engine.key_secret "
                              "and worker1.key .. on the engine host)")
        return NodeLayout(nnodes, addr, port, Path(keys))

    @property
    def remote(self) -> bool:
        return self.nnodes > 1

    def per_node(self, world_size: int) -> int:
        return world_size // self.nnodes

    def node_of(self, rank: int, world_size: int) -> int:
        return rank // self.per_node(world_size)

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"

    def channel(self, node: int, host: str | None = None) -> str:
        """Node ``node``'s endpoint of the executor's channel (``host``: to bind)."""
        return f"tcp://{host or self.master_addr}:{self.master_port + node}"

    def node_keys(self) -> tuple[bytes, bytes, dict[int, bytes]]:
        """(the engine's public and secret CURVE keys, node -> its allowed public key)."""
        import zmq.auth

        if self.curve is not None:
            return self.curve
        assert self.keys is not None
        public, secret = zmq.auth.load_certificate(str(self.keys / "engine.key_secret"))
        if secret is None:
            raise LayoutError(f"{self.keys}/engine.key_secret holds no secret key")
        allowed = {}
        for node in range(1, self.nnodes):
            path = self.keys / f"worker{node}.key"
            if not path.is_file():
                raise LayoutError(f"{path} is missing: node {node} joins with worker{node}'s "
                                  f"key (`deltacast keys DIR --workers {self.nnodes - 1}`)")
            allowed[node] = zmq.auth.load_certificate(str(path))[0]
        return public, secret, allowed


def hello_mismatch(fields: dict[str, str], node: int, config_hash: str) -> str | None:
    """What a remote rank's hello (:func:`protocol.calls.parse_hello`) disagrees on with
    this engine, whose vLLM config hashes to ``config_hash`` (one line), or None."""
    import vllm

    from protocol.messages import PROTOCOL_MAJOR

    ours = {"node": str(node), "vllm": vllm.__version__, "protocol": str(PROTOCOL_MAJOR),
            "config": config_hash}
    what = {"node": "node rank (its ranks belong to another node: check --node-rank)",
            "vllm": "vLLM version", "protocol": "deltacast protocol major version",
            "config": "vLLM config hash (start every node with the same vLLM arguments)"}
    wrong = [f"{what[k]}: {fields[k]} here, {ours[k]} on the engine" for k in ours
             if fields[k] != ours[k]]
    return "; ".join(wrong) or None
