"""Comparing the ranks' lagged token hashes (pure: no vLLM, no zmq).

The ranks that sample (the last pipeline stage) check in with the rolling hash of
their sampled tokens at equal output counts (payload: :mod:`protocol.calls`).
The board keeps each count's hashes until every such rank has reported it, and
compares each rank with the reference rank (the executor's output rank: its
tokens are the ones the engine uses).  A rank that differs is named once; its
rolling hash can never agree again, so it is not compared any further.
:class:`DivergenceWatch` adds what the executor does with a divergence.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from protocol.calls import parse_check_in
from protocol.errors import MalformedMessage, ProtocolError
from protocol.faults import PeerFaults

log = logging.getLogger("deltacast.vllm.executor")


@dataclass(frozen=True)
class RankDiverged:
    """``rank``'s sampled tokens differ from ``source_rank``'s within its first ``steps``
    model outputs (the check-in that showed it)."""

    rank: int
    steps: int
    source_rank: int


class TokenHashBoard:
    """Check-ins in, divergences out.  ``history`` bounds the counts awaiting a rank."""

    def __init__(self, ranks: Iterable[int], reference: int, history: int = 64) -> None:
        self.ranks = frozenset(ranks)
        if reference not in self.ranks:
            raise ValueError(f"reference rank {reference} is not among {sorted(self.ranks)}")
        self.reference = reference
        self.history = history
        self.pending: OrderedDict[int, dict[int, int]] = OrderedDict()
        self.diverged: dict[int, RankDiverged] = {}
        self.compared = 0  # (rank, count) pairs compared

    def check_in(self, rank: int, frames: list[bytes]) -> list[RankDiverged]:
        """:meth:`report` of a check-in's frames (after its kind); MalformedMessage,
        nothing recorded, for frames that are not one payload or a rank that does not
        sample."""
        if len(frames) != 1 or rank not in self.ranks:
            raise MalformedMessage("not a sampling rank's check-in", rank=rank,
                                   frames=len(frames))
        return self.report(rank, *parse_check_in(frames[0]))

    def report(self, rank: int, steps: int, value: int) -> list[RankDiverged]:
        """Record ``rank``'s hash after ``steps`` outputs; the divergences it reveals."""
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} does not sample (samplers: {sorted(self.ranks)})")
        seen = self.pending.setdefault(steps, {})
        seen[rank] = value
        ref = self.reference
        others = [r for r in seen if r != ref] if rank == ref else [rank]
        found = [] if ref not in seen else \
            [e for r in others if (e := self._check(r, steps, seen[r], seen[ref]))]
        if seen.keys() == self.ranks:
            del self.pending[steps]
        while len(self.pending) > self.history:  # a rank stopped reporting: forget
            self.pending.popitem(last=False)
        return found

    def _check(self, rank: int, steps: int, value: int, want: int) -> RankDiverged | None:
        if rank in self.diverged:
            return None
        self.compared += 1
        if value == want:
            return None
        self.diverged[rank] = event = RankDiverged(rank, steps, self.reference)
        return event


class DivergenceWatch(TokenHashBoard):
    """The board, and what a divergence does: logged, kept in :attr:`divergent`, passed
    to each of :attr:`callbacks` (on the thread that heard the check-in).  A malformed
    check-in, or one from a rank that does not sample, is dropped and counted."""

    def __init__(self, ranks: Iterable[int], reference: int, faults: PeerFaults) -> None:
        super().__init__(ranks, reference)
        self.faults = faults
        self.divergent: list[RankDiverged] = []
        self.callbacks: list[Callable[[RankDiverged], None]] = []

    def restart(self) -> None:
        """Forget the check-ins of a group that was restarted (its counts start again)."""
        self.pending.clear()
        self.diverged.clear()

    def hear(self, rank: int, frames: list[bytes]) -> None:
        try:
            events = self.check_in(rank, frames)
        except ProtocolError as exc:
            self.faults.hit(f"rank {rank}", exc)
            return
        for event in events:
            self.divergent.append(event)
            log.error("DeltaExecutor rank %d diverged: its sampled tokens differ from rank "
                      "%d's (the output rank) within the first %d model outputs",
                      event.rank, event.source_rank, event.steps)
            for callback in self.callbacks:
                callback(event)

