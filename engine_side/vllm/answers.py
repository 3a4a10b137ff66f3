"""The DeltaExecutor's answers from its ranks, kept in call order (SPEC §16).

Every rank answers every call exactly once, in call order, through its reply ring or
its DEALER; an ON_PUB marker in the reply ring keeps the place of an answer too large
for it, which comes on the DEALER.  :class:`Answers` files them per rank and hands
out one answer per rank once every rank's next one is in.  A record or an answer
that is not one is that rank's fault, raised as :class:`RankFault` naming the rank:
its answers are out of step with the calls, so the executor fails.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from protocol.calls import ANSWER_KINDS
from protocol.errors import MalformedMessage, ProtocolError, malformed
from protocol.ring import MESSAGE, unpack_frames


class RankFault(Exception):
    """``rank`` sent a malformed answer (``error``, a ProtocolError)."""

    def __init__(self, rank: int, error: ProtocolError) -> None:
        super().__init__(f"rank {rank}: {error}")
        self.rank, self.error = rank, error


class Answers:
    """Per rank, its answers in call order (None: the place of one coming on the
    DEALER); ``stats["socket_replies"]`` counts the answers filed into such places."""

    def __init__(self, world_size: int, stats: Counter[str]) -> None:
        self.boxes: list[deque[list[bytes] | None]] = [deque() for _ in range(world_size)]
        self.stats = stats

    def ring_record(self, rank: int, kind: int, payload: bytes) -> None:
        """A record of ``rank``'s reply ring: an answer, or a marker keeping its place."""
        try:
            answer = [bytes(f) for f in unpack_frames(payload)] if kind == MESSAGE else None
        except ValueError as exc:
            raise RankFault(rank, malformed("a reply ring record that is not an answer",
                                            exc)) from exc
        self.boxes[rank].append(answer)

    def socket(self, rank: int, frames: list[bytes]) -> None:
        """An answer on ``rank``'s DEALER: into the place its marker kept, else at the end."""
        box = self.boxes[rank]
        for i, held in enumerate(box):
            if held is None:
                box[i] = frames
                self.stats["socket_replies"] += 1
                return
        box.append(frames)

    def owing(self) -> list[int]:
        """The ranks whose next answer is not in (nor announced by a marker)."""
        return [rank for rank, box in enumerate(self.boxes) if not box]

    def waiting(self) -> bool:
        """Whether some rank's next answer is not in yet."""
        return any(not box or box[0] is None for box in self.boxes)

    def take(self) -> list[list[bytes]]:
        """Every rank's next answer (call :meth:`waiting` first); RankFault for the first
        rank whose answer is not one."""
        replies: list[list[bytes]] = [box.popleft() for box in self.boxes]  # type: ignore[misc]
        for rank, frames in enumerate(replies):
            if not frames or frames[0] not in ANSWER_KINDS:
                raise RankFault(rank, MalformedMessage("not an answer to a call",
                                                       kind=frames[0][:8] if frames else b""))
        return replies


class Reply(Future):  # type: ignore[type-arg]
    """A call's result; ``result()`` first has ``drain`` resolve every earlier call (in
    order) and this one."""

    def __init__(self, drain: Callable[[Reply], None], convert: Callable[[list[Any]], Any],
                 deadline: float | None) -> None:
        super().__init__()
        self.drain, self.convert, self.deadline = drain, convert, deadline

    def result(self, timeout: float | None = None) -> Any:
        self.drain(self)
        return super().result(timeout)


class Sampled(Future):  # type: ignore[type-arg]
    """``execute_model``'s result for a step sent as one ``T`` call (SPEC §16.1), whose
    answer ``reply`` is ``sample_tokens``': None once ``reply`` resolves (its
    exception if it failed), so futures still resolve in submission order;
    ``result()`` drives ``reply`` as :meth:`Reply.result` does."""

    def __init__(self, reply: Reply) -> None:
        super().__init__()
        self.reply = reply
        reply.add_done_callback(self._resolve)

    def _resolve(self, reply: Future) -> None:  # type: ignore[type-arg]
        error = reply.exception()
        if error is None:
            self.set_result(None)
        else:
            self.set_exception(error)

    def result(self, timeout: float | None = None) -> Any:
        self.reply.drain(self.reply)
        return super().result(timeout)
