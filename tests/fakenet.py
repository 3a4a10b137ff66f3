"""A fake lossy PUB/SUB network for sans-I/O tests: one in-memory link per worker.

Every message crosses the "wire" as bytes: :meth:`FakeNetwork.publish` encodes it
with :func:`protocol.codec.encode` and copies each frame into ``bytes`` (no
aliasing of the sender's tensors), and :meth:`Link.pop` hands back frames that
the caller decodes with :func:`protocol.codec.decode`.  Loss, duplication and
reordering are explicit operations a test (or a Hypothesis rule) chooses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import codec
from protocol.messages import Message

Frames = list[bytes]


def to_wire(msg: Message) -> Frames:
    """Encode ``msg`` and copy every frame into bytes, as a socket would."""
    return [bytes(f) for f in codec.encode(msg)]


@dataclass
class Link:
    """The in-flight messages towards one worker, oldest first."""

    queue: list[Frames] = field(default_factory=list)
    sent: int = 0
    dropped: int = 0

    def push(self, frames: Frames, front: bool = False) -> None:
        """Queue a message (``front``: overtake everything in flight)."""
        self.sent += 1
        if front:
            self.queue.insert(0, frames)
        else:
            self.queue.append(frames)

    def pop(self) -> Frames:
        """Remove and return the oldest message (IndexError when empty)."""
        return self.queue.pop(0)

    def drop(self, i: int) -> None:
        del self.queue[i]
        self.dropped += 1

    def duplicate(self, i: int) -> None:
        """Deliver message ``i`` twice (the copy follows the original)."""
        self.queue.insert(i + 1, list(self.queue[i]))

    def swap(self, i: int, j: int) -> None:
        self.queue[i], self.queue[j] = self.queue[j], self.queue[i]


@dataclass
class FakeNetwork:
    """One link per worker; publishing fans a message out to every link."""

    links: list[Link] = field(default_factory=list)

    def join(self) -> int:
        """A new subscriber: it only sees messages published from now on."""
        self.links.append(Link())
        return len(self.links) - 1

    def publish(self, msg: Message) -> None:
        frames = to_wire(msg)
        for link in self.links:
            link.push(list(frames))

    def send(self, worker: int, msg: Message, front: bool = False) -> None:
        """Point-to-point (a snapshot answer); ``front`` models an out-of-band channel."""
        self.links[worker].push(to_wire(msg), front=front)

    def busy(self) -> list[int]:
        """Workers with at least one message in flight."""
        return [i for i, link in enumerate(self.links) if link.queue]
