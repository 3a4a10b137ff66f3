"""Bad input from peers, counted per peer and logged once per peer (pure: no I/O but
logging, no clock).

A peer's message that does not decode (a :class:`~protocol.errors.ProtocolError`) is
that peer's fault, never the receiving process's: the receiving loop drops it, calls
:meth:`PeerFaults.hit` and carries on.  The first fault of each peer is logged (with
the error); later ones are only counted, so a hostile or broken peer cannot flood
the log.  At most ``max_peers`` peers are tracked by name (peer identities come off
the wire): faults of any further peer are counted under :data:`OTHER_PEERS`, and
logged once for all of them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable

#: the name counting the faults of peers beyond ``max_peers``
OTHER_PEERS = "(other peers)"


class PeerFaults:
    """Faults of ``what`` (e.g. "dropped a worker message that does not decode") by
    peer: ``total``, ``by_peer[peer]``."""

    def __init__(self, log: logging.Logger, what: str, max_peers: int = 1024) -> None:
        self.log, self.what, self.max_peers = log, what, max_peers
        self.total = 0
        self.by_peer: Counter[Hashable] = Counter()

    def hit(self, peer: Hashable, error: BaseException) -> None:
        """Count one fault of ``peer``; log it if it is that peer's first."""
        if self.count(peer) == 1:
            self.log.warning("%s from %s: %s (further ones from it are only counted)",
                             self.what, _name(peer), error)

    def count(self, peer: Hashable) -> int:
        """Count one fault of ``peer`` without logging it; its faults so far."""
        self.total += 1
        if peer not in self.by_peer and len(self.by_peer) >= self.max_peers:
            peer = OTHER_PEERS
        self.by_peer[peer] += 1
        return self.by_peer[peer]


def _name(peer: Hashable) -> str:
    if isinstance(peer, bytes):
        return f"peer {peer[:64]!r}"
    return str(peer)
