"""The names of an engine's two endpoints (SPEC §3): pure naming, no sockets.

``ipc://DIR`` → ``DIR/pub`` (the broadcast channel) and ``DIR/ctl`` (the control
channel); ``tcp://HOST:PORT`` → PORT and PORT + 1.  Whether DIR is private is checked
by each end before it binds or connects (:mod:`protocol.ipc_dir`).
"""

from __future__ import annotations

#: the per-message size limit both ends apply by default (zmq's MAXMSGSIZE per frame)
DEFAULT_MAX_MESSAGE_BYTES = 256 << 20


def channel_endpoints(endpoint: str) -> tuple[str, str]:
    """(PUB, ROUTER) endpoints of an engine: ``ipc://DIR`` → DIR/pub, DIR/ctl;
    ``tcp://HOST:PORT`` → PORT and PORT + 1 (ValueError for anything else)."""
    if endpoint.startswith("ipc://"):
        base = endpoint.rstrip("/")
        return f"{base}/pub", f"{base}/ctl"
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"{endpoint}: a tcp endpoint needs an explicit port")
        return endpoint, f"{host}:{int(port) + 1}"
    raise ValueError(f"{endpoint}: use ipc://DIR or tcp://HOST:PORT")


def ipc_directory(endpoint: str) -> str | None:
    """DIR of an ``ipc://DIR`` endpoint (None for any other)."""
    return endpoint[len("ipc://"):].rstrip("/") if endpoint.startswith("ipc://") else None
