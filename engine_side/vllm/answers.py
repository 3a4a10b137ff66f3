"""The DeltaExecutor's answers from its ranks, kept in call order (SPEC §16.1).

Every rank answers every call once, in call order, through its reply ring or its
DEALER; an ON_PUB marker in the reply ring keeps the place of an answer too large for
it, which comes on the DEALER.  A rank other than the output rank may answer step
calls late and several at once (``K`` with a count): a step call resolves on its output
rank's answer, and the others' answers to it settle as they come.  :class:`Answers`
files them per rank and hands out a call's answers once the ranks it needs have
answered.  A record or an answer that is not one is that rank's fault, raised as
:class:`RankFault` naming the rank: its answers are out of step with the calls, so the
executor fails; so does an ``E`` that settles a step call already resolved.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from protocol.calls import ANSWER_KINDS, DONE, ERROR, done_count
from protocol.errors import MalformedMessage, ProtocolError, malformed
from protocol.ring import MESSAGE, unpack_frames


class RankFault(Exception):
    """``rank`` sent a malformed answer (``error``, a ProtocolError), or failed a step
    call that had already resolved (``error`` the rank's exception text)."""

    def __init__(self, rank: int, error: ProtocolError | str) -> None:
        super().__init__(f"rank {rank}: {error}")
        self.rank, self.error = rank, error


class Answers:
    """Per rank, its answers in call order (None: the place of one coming on the
    DEALER); ``stats["socket_replies"]`` counts the answers filed into such places."""

    def __init__(self, world_size: int, stats: Counter[str]) -> None:
        self.boxes: list[deque[list[bytes] | None]] = [deque() for _ in range(world_size)]
        self.owed = [0] * world_size  # step calls resolved before this rank answered them
        self.late = [0] * world_size  # of those, answers coming on the DEALER
        self.stats = stats

    def ring_record(self, rank: int, kind: int, payload: bytes) -> None:
        """A record of ``rank``'s reply ring: an answer, or a marker keeping its place."""
        try:
            answer = [bytes(f) for f in unpack_frames(payload)] if kind == MESSAGE else None
        except MalformedMessage as exc:
            raise RankFault(rank, malformed("a reply ring record that is not an answer",
                                            exc)) from exc
        self._file(rank, answer)

    def socket(self, rank: int, frames: list[bytes]) -> None:
        """An answer on ``rank``'s DEALER: for a settled call whose place a marker kept,
        into a place kept in its box, else as the next answer."""
        if len(frames) > 1 and frames[0] == DONE and (self.late[rank] or None in self.boxes[rank]):
            raise RankFault(rank, MalformedMessage("a K answering several calls in the "
                                                   "place of one"))
        if self.late[rank]:
            self.late[rank] -= 1
            self.stats["socket_replies"] += 1
            self._settle(rank, frames)
            return
        box = self.boxes[rank]
        for i, held in enumerate(box):
            if held is None:
                box[i] = frames
                self.stats["socket_replies"] += 1
                return
        self._file(rank, frames)

    def _file(self, rank: int, answer: list[bytes] | None) -> None:
        count = done_count(answer) if answer and answer[0] == DONE else 1
        if count is None:
            raise RankFault(rank, MalformedMessage("a K answer's count is not a uint32 > 0"))
        settled = min(count, self.owed[rank])  # answers to calls already resolved
        if settled:
            self.owed[rank] -= settled
            if answer is None:  # a marker (count 1): its answer settles on the DEALER
                self.late[rank] += 1
            else:
                self._settle(rank, answer)
        self.boxes[rank].extend([answer] * (count - settled))

    def _settle(self, rank: int, answer: list[bytes]) -> None:
        if answer[:1] == [ERROR]:
            raise RankFault(rank, b"".join(answer[1:]).decode(errors="replace"))
        if answer[:1] != [DONE]:
            raise RankFault(rank, MalformedMessage("not the answer to a step call",
                                                   kind=answer[0][:8] if answer else b""))

    def owing(self) -> list[int]:
        """The ranks whose next answer is not in (nor announced by a marker)."""
        return [rank for rank, box in enumerate(self.boxes) if not box]

    def waiting(self, needed: Sequence[int]) -> bool:
        """Whether a rank in ``needed`` lacks its answer to the next call."""
        return any(not self.boxes[r] or self.boxes[r][0] is None for r in needed)

    def take(self, needed: Sequence[int]) -> list[list[bytes] | None]:
        """Every rank's answer to the next call, None where a rank outside ``needed`` has
        not answered it yet (call :meth:`waiting` first); RankFault for the first rank
        whose answer is not one."""
        replies: list[list[bytes] | None] = []
        for rank, box in enumerate(self.boxes):
            if box and (box[0] is not None or rank in needed):
                replies.append(box.popleft())
                continue
            if box:  # a marker: the answer settles when it comes on the DEALER
                box.popleft()
                self.late[rank] += 1
            else:  # not in yet: settled when it comes
                self.owed[rank] += 1
            replies.append(None)
        for rank, frames in enumerate(replies):
            if frames is not None and (not frames or frames[0] not in ANSWER_KINDS):
                raise RankFault(rank, MalformedMessage("not an answer to a call",
                                                       kind=frames[0][:8] if frames else b""))
        return replies


class Reply(Future):  # type: ignore[type-arg]
    """A call's result; ``result()`` first has ``drain`` resolve every earlier call (in
    order) and this one."""

    def __init__(self, drain: Callable[[Reply], None], convert: Callable[[list[Any]], Any],
                 deadline: float | None, needed: Sequence[int], step: bool = False) -> None:
        super().__init__()
        self.drain, self.convert, self.deadline = drain, convert, deadline
        self.needed = needed  # the ranks whose answers it waits for
        self.step = step  # a model step (its deadline: vLLM's step timeout)

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
