"""Who may speak for which rank, and how often (sans-I/O: every input takes ``now``).

The engine's ROUTER hears every worker through one socket; each message carries the
*principal* the transport vouches for (:meth:`EngineTransport.recv_from`):

* ``key:<z85>``: the CURVE public key the ZAP allow list admitted (tcp);
* ``pid:<pid>``: the connecting process, from the kernel (``SO_PEERCRED``, ipc);
* ``ring:<rank>``: a reply ring, which is one rank's by construction;
* ``None``: nobody vouches (tcp with ``--insecure``, test transports): no binding.

Rules (SPEC.md §13):

* **Binding.**  A principal is bound to the rank its first accepted message names
  (check-in, snapshot request or step result), for the engine's lifetime; an operator
  may *pin* a key to a set of ranks instead (the demo's locally spawned workers share
  one key, pinned to their ranks).  A message naming another rank, or a rank outside
  ``ranks``, is dropped and counted.
* **Ownership.**  A rank is owned by one principal.  A key's rank is its own for the
  engine's lifetime (a restarted worker comes back with its key); a process's rank
  (``pid:``) passes to another process only once the owner's session is dead.  A
  supervisor that spawns a rank's process names it (:meth:`PeerBook.expect`): then no
  other process may speak for that rank at all.
* **One live session per rank.**  A session is a worker process (the pid in its
  check-ins; over tcp the pid its DEALER names itself with, ``RANK-PID``).  A second
  process claiming a rank whose session is alive -- with the same key, or on ipc any
  other process -- is refused until that session is dead (no check-in for the
  liveness bound, its exit seen, or its Goodbye): the first one stays, the newcomer
  retries.
* **Rates.**  Snapshot requests cost the engine a whole snapshot: each principal may
  ask ``snapshot_burst`` at once and ``snapshot_rate`` a second after that.  Every
  refused message counts as a fault; a principal past ``fault_burst`` faults (refilled
  at ``fault_rate`` a second) is *muted* for ``mute_s`` seconds: the transport drops its
  frames before decoding them.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from protocol.faults import PeerFaults

log = logging.getLogger("deltacast.engine.peers")

Principal = bytes | None

#: why a message was refused (the keys of :attr:`PeerBook.refused`)
UNKNOWN_RANK, WRONG_RANK, RANK_TAKEN, SECOND_SESSION = (
    "unknown rank", "wrong rank", "rank taken", "second session")
RATE_LIMITED, BAD_RESULT, UNDECODABLE = "rate limited", "bad result", "undecodable"

_ROUTE = re.compile(rb"(-?\d{1,9})-(\d{1,10})")  # the core worker's DEALER identity


def declared_pid(identity: bytes) -> int | None:
    """The pid a core worker's DEALER names itself with (``RANK-PID``), else None."""
    m = _ROUTE.fullmatch(identity)
    return int(m.group(2)) if m else None


def curve_principal(z85_key: bytes | str) -> bytes:
    """The principal of a CURVE public key (z85, as the ZAP handler sees it)."""
    return b"key:" + (z85_key.encode() if isinstance(z85_key, str) else z85_key)


class Refused(Exception):
    """Why a peer's message was refused (what :class:`PeerFaults` logs)."""


@dataclass
class Bucket:
    """A token bucket: ``burst`` at once, ``rate`` a second after that."""

    rate: float
    burst: float
    level: float
    at: float

    def take(self, now: float) -> bool:
        self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if self.level < 1.0:
            return False
        self.level -= 1.0
        return True


class PeerBook:
    """Bindings, ownership, sessions and rates (see the module docstring).

    Args:
        ranks: the ranks that exist (None: any rank).
        pinned: principal -> the ranks it may speak for (each owned by it from the start).
        max_peers: principals tracked at most (bindings stay; buckets are recycled).
    """

    def __init__(self, ranks: Collection[int] | None = None,
                 pinned: Mapping[bytes, Collection[int]] | None = None, *,
                 snapshot_rate: float = 2.0, snapshot_burst: float = 4.0,
                 fault_rate: float = 20.0, fault_burst: float = 200.0, mute_s: float = 1.0,
                 max_peers: int = 4096) -> None:
        self.ranks = None if ranks is None else frozenset(ranks)
        self.pinned = {p: frozenset(r) for p, r in (pinned or {}).items()}
        self.bound: dict[bytes, int] = {}
        self.owner: dict[int, bytes] = {r: p for p, rs in self.pinned.items() for r in rs}
        self.expected: dict[int, int] = {}  # rank -> the pid its supervisor started
        self.snapshot_rate, self.snapshot_burst = snapshot_rate, snapshot_burst
        self.fault_rate, self.fault_burst, self.mute_s = fault_rate, fault_burst, mute_s
        self.max_peers = max_peers
        self._snapshots: dict[Hashable, Bucket] = {}
        self._faults: dict[Hashable, Bucket] = {}
        #: refused messages by reason, and by peer (each peer's first is logged)
        self.refused: Counter[str] = Counter()
        self.faults = PeerFaults(log, "refused a worker message", max_peers)
        self.mutes = 0

    # -- binding ---------------------------------------------------------------------
    def claim(self, principal: Principal, rank: int, pid: int | None,
              live_pid: int | None) -> str | None:
        """May ``principal`` (its process ``pid`` if known) speak for ``rank``, whose live
        session is ``live_pid`` (None: no live session)?  None = yes (and bound now);
        otherwise the reason it is refused."""
        if self.ranks is not None and rank not in self.ranks:
            return UNKNOWN_RANK
        if principal is None:
            return None  # nobody vouches for the sender: nothing to bind
        if principal.startswith(b"ring:"):
            return None if principal == b"ring:%d" % rank else WRONG_RANK
        allowed = self.pinned.get(principal)
        if allowed is not None:
            if rank not in allowed:
                return WRONG_RANK
        elif self.bound.get(principal, rank) != rank:
            return WRONG_RANK
        owner = self.owner.get(rank)
        want = self.expected.get(rank)
        if want is not None and pid is not None and pid != want:
            return SECOND_SESSION if owner == principal else RANK_TAKEN
        if owner is not None and owner != principal:
            if not owner.startswith(b"pid:") or live_pid not in (None, want):
                return RANK_TAKEN  # a key's rank stays its own; a live process keeps its
        elif pid is not None and live_pid not in (None, pid) and pid != want:
            return SECOND_SESSION
        if allowed is None:
            self.bound[principal] = rank
        self.owner[rank] = principal
        return None

    def expect(self, rank: int, pid: int) -> None:
        """The next session of ``rank`` is process ``pid`` (a supervisor that spawned it
        says so): no other process may speak for the rank (on ipc, where the kernel names
        the process, not even before that one has said anything)."""
        self.expected[rank] = pid
        owner = self.owner.get(rank)
        if owner is None or owner.startswith(b"pid:"):
            self.owner[rank] = b"pid:%d" % pid

    def follow(self, procs: Mapping[int, Any]) -> list[Any]:
        """:meth:`expect` each process of ``procs`` (rank -> a spawned process, with a
        ``pid``) that is new; a session tick (returns no events)."""
        for rank, proc in procs.items():
            if self.expected.get(rank) != proc.pid:
                self.expect(rank, proc.pid)
        return []

    def rank_of(self, principal: Principal) -> int | None:
        """The one rank ``principal`` is bound to (None: none yet, or pinned to several)."""
        if principal is None:
            return None
        if principal.startswith(b"ring:"):
            return int(principal[5:])
        pinned = self.pinned.get(principal)
        if pinned is not None:
            return next(iter(pinned)) if len(pinned) == 1 else None
        return self.bound.get(principal)

    # -- rates -----------------------------------------------------------------------
    def allow_snapshot(self, peer: Hashable, now: float) -> bool:
        """One snapshot request of ``peer``: False when it is over its rate."""
        return self._bucket(self._snapshots, peer, now, self.snapshot_rate,
                            self.snapshot_burst).take(now)

    def refuse(self, peer: Hashable, reason: str, now: float, detail: object = "") -> bool:
        """Count a refused message of ``peer``; True when ``peer`` is now to be muted."""
        self.refused[reason] += 1
        self.faults.hit(peer, Refused(f"{reason}{': ' if detail else ''}{detail}"))
        over = not self._bucket(self._faults, peer, now, self.fault_rate,
                                self.fault_burst).take(now)
        if over:
            self.mutes += 1
            del self._faults[peer]  # a fresh budget once the mute is over
            if self.mutes % 100 == 1:
                log.warning("muting %s for %.1f s: over %d refused messages (%d mutes so "
                            "far, one in 100 logged)", _name(peer), self.mute_s,
                            int(self.fault_burst), self.mutes)
        return over

    def _bucket(self, table: dict[Hashable, Bucket], peer: Hashable, now: float,
                rate: float, burst: float) -> Bucket:
        bucket = table.get(peer)
        if bucket is None:
            if len(table) >= self.max_peers:
                table.pop(next(iter(table)))  # the oldest peer's budget starts afresh
            bucket = table[peer] = Bucket(rate, burst, burst, now)
        return bucket


def _name(peer: Hashable) -> str:
    return repr(peer[:64]) if isinstance(peer, bytes) else str(peer)
