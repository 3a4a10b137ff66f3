"""The local step ring's shared vocabulary (SPEC §7.6): segment layout, header words,
record format and the byte rings, read and written on an already mapped segment.

Both ends use it: the engine creates the segment and writes the step ring
(:mod:`engine_side.ring`), a worker attaches to it and writes its reply ring
(:mod:`worker_side.ring`); a node's relay owns a segment of its own for the ranks on
its host (:mod:`worker_side.vllm.relay`).  :class:`OwnedRing` is the creating end both
writers share (a memfd announced in ``DIR/ring``, as :mod:`protocol.ipc_dir` is the
directory check both ends share); the rest reads and writes bytes in a buffer it is
given.

The segment holds:

* a **step ring**: one writer (the engine), any number of readers (the workers).
  Records are appended at a monotonic byte ``head``; each reader keeps its own
  cursor.  The writer never waits for readers: a reader that falls more than the
  ring's capacity behind is *overrun* and must resync (the replica sees a gap),
  exactly as a PUB subscriber past its high-water mark.
* a **reply ring** per rank (one writer: that rank's worker; one reader: the engine).
* per rank, a ``sleeping`` word: a worker that stops spinning sets it before it
  blocks on its SUB socket; a writer that sees it set sends a doorbell on PUB (the
  vLLM channel's ranks: one byte into the rank's FIFO ``DIR/bell.RANK`` instead,
  :meth:`OwnedRing.wake`, a wake-up with no socket's I/O threads between the ends).

Ordering.  The writer copies a record, then (after a memory fence) publishes the
new head; a reader reads the head, fences, then copies.  After copying, the reader
re-reads the head: if the writer has meanwhile lapped the reader's start, what was
copied may be torn and the whole read is reported as an overrun (never delivered).

Records (8-byte aligned): ``u32 length, u32 kind, payload``.  Kinds: ``MESSAGE``
(payload: ``u32 n``, ``n`` × ``u64`` frame lengths, the frames), ``ON_PUB`` (payload:
``u64 seq``: that message was too large for the ring and went on PUB), ``WRAP``
(the rest of the ring is unused: continue at offset 0).

Not thread-safe: each end is used by one thread.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import stat
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol.errors import MalformedMessage

MAGIC = 0x676E_6952_6364  # "dcRing" (little-endian)
VERSION = 1
RING_FILE = "ring"
BELL_FILE = "bell.{}"  # DIR/bell.RANK: rank RANK's doorbell, a FIFO (the vLLM channel)
MAX_RANKS = 64
DEFAULT_RING_BYTES = 32 << 20
DEFAULT_REPLY_BYTES = 256 << 10
MIN_BYTES = 1024
MESSAGE, ON_PUB, WRAP = 1, 2, 3
HEADER_WORDS = 16  # magic, version, ring bytes, ranks, reply bytes, closed, head, ...
W_MAGIC, W_VERSION, W_RING, W_RANKS, W_REPLY, W_CLOSED, W_HEAD = range(7)
_RECORD = struct.Struct("<II")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# A memory fence, not a lock: nothing here starts a thread or excludes one.  Acquiring
# and releasing a lock is an atomic read-modify-write, i.e. a full barrier between the
# stores and loads of this process and those of the other end (vLLM's shm queue does
# the same).  The only use of ``threading`` in protocol/.
_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier (a lock's atomic read-modify-write), as vLLM's shm queue."""
    _fence_lock.acquire()
    _fence_lock.release()


def _align(n: int) -> int:
    return (n + 7) & ~7


@dataclass(frozen=True)
class Layout:
    """Offsets of one segment (all sizes multiples of 8; the header is page-aligned)."""

    ring_bytes: int
    reply_bytes: int
    ranks: int = MAX_RANKS

    @staticmethod
    def of(segment: Any) -> Layout | None:
        """The layout a segment's header announces; None if it is not a ring of VERSION."""
        words = struct.unpack_from(f"<{HEADER_WORDS}Q", segment)
        if words[W_MAGIC] != MAGIC or words[W_VERSION] != VERSION:
            return None
        return Layout(words[W_RING], words[W_REPLY], words[W_RANKS])

    @property
    def header_bytes(self) -> int:
        words = HEADER_WORDS + 2 * self.ranks  # then every rank's sleeping word, reply head
        return -(-words * 8 // mmap.PAGESIZE) * mmap.PAGESIZE

    @property
    def size(self) -> int:
        return self.header_bytes + self.ring_bytes + self.ranks * self.reply_bytes

    @staticmethod
    def sleeping_word(rank: int) -> int:
        return HEADER_WORDS + rank

    def reply_word(self, rank: int) -> int:
        return HEADER_WORDS + self.ranks + rank

    def reply_offset(self, rank: int) -> int:
        return self.header_bytes + self.ring_bytes + rank * self.reply_bytes


class Region:
    """One byte ring inside the segment: ``data`` plus its head word ``words[at]``."""

    def __init__(self, data: memoryview, words: memoryview, at: int) -> None:
        self.data, self.words, self.at = data, words, at
        self.capacity = len(data)

    def head(self) -> int:
        return self.words[self.at]  # type: ignore[no-any-return]

    def write(self, kind: int, parts: Sequence[Any], limit: int | None = None) -> bool:
        """Append one record made of ``parts``; False if it is larger than ``limit``
        (default and at most: half the capacity)."""
        size = sum(memoryview(p).nbytes for p in parts)
        need = 8 + _align(size)
        if need > min(limit or self.capacity, self.capacity // 2):
            return False
        head = self.head()
        pos = head % self.capacity
        if pos + need > self.capacity:  # never straddle the end: mark the rest unused
            _RECORD.pack_into(self.data, pos, 0, WRAP)
            head += self.capacity - pos
            pos = 0
        _RECORD.pack_into(self.data, pos, size, kind)
        at = pos + 8
        for part in parts:
            n = memoryview(part).nbytes
            self.data[at:at + n] = memoryview(part).cast("B")
            at += n
        fence()  # the record is complete before the head says so
        self.words[self.at] = head + need
        return True

    def read(self, cursor: int) -> tuple[int, list[tuple[int, bytes]] | None]:
        """Records from ``cursor`` to the head: (new cursor, records), or (head, None)
        when the writer lapped the cursor (the records are lost: overrun)."""
        head = self.head()
        if head == cursor:
            return cursor, []
        fence()
        start, out = cursor, []
        if head - start > self.capacity:
            return head, None
        while cursor < head:
            pos = cursor % self.capacity
            size, kind = _RECORD.unpack_from(self.data, pos)
            if pos + 8 + size > self.capacity:  # not a record we wrote: lapped mid-read
                return self.head(), None
            if kind == WRAP:
                cursor += self.capacity - pos
                continue
            out.append((kind, bytes(self.data[pos + 8:pos + 8 + size])))
            cursor += 8 + _align(size)
        fence()
        if self.head() - start > self.capacity:  # lapped while we copied: maybe torn
            return self.head(), None
        return cursor, out


def pack_frames(frames: Sequence[Any]) -> list[Any]:
    """A MESSAGE payload's parts: count, lengths, then the frames themselves."""
    lengths = [memoryview(f).nbytes for f in frames]
    return [struct.pack(f"<I{len(lengths)}Q", len(lengths), *lengths), *frames]


def unpack_frames(payload: bytes) -> list[memoryview]:
    """The frames of a MESSAGE payload (MalformedMessage if it is not one)."""
    view = memoryview(payload)
    if len(view) < 4:
        raise MalformedMessage("a ring message without its frame count", size=len(view))
    (n,) = _U32.unpack_from(view, 0)
    if n > (len(view) - 4) // 8:
        raise MalformedMessage("a ring message's frame count exceeds the record", count=n)
    lengths = struct.unpack_from(f"<{n}Q", view, 4)
    at, frames = 4 + 8 * n, []
    for length in lengths:
        if at + length > len(view):
            raise MalformedMessage("a ring message's frame exceeds the record",
                                   size=len(view))
        frames.append(view[at:at + length])
        at += length
    return frames


class Segment:
    """A mapped segment (``mm``: the mapping, closed by :meth:`close`): the header
    words and the regions."""

    def __init__(self, mm: mmap.mmap, layout: Layout) -> None:
        self.mm, self.layout = mm, layout
        view = memoryview(mm)
        self.words = view[:layout.header_bytes].cast("Q")  # aligned 8-byte loads and stores
        ring_at = layout.header_bytes
        self.ring = Region(view[ring_at:ring_at + layout.ring_bytes], self.words, W_HEAD)
        self.replies = [
            Region(view[layout.reply_offset(r):layout.reply_offset(r) + layout.reply_bytes],
                   self.words, layout.reply_word(r)) for r in range(layout.ranks)]
        self.sleeping = view[HEADER_WORDS * 8:(HEADER_WORDS + layout.ranks) * 8]
        self.reply_heads = view[layout.reply_word(0) * 8:layout.reply_word(layout.ranks) * 8]
        self.awake = bytes(len(self.sleeping))

    def format(self) -> None:
        """Write a fresh segment's header (the writer, once); the magic goes last."""
        w, layout = self.words, self.layout
        w[W_VERSION], w[W_RING], w[W_RANKS], w[W_REPLY] = (VERSION, layout.ring_bytes,
                                                           layout.ranks, layout.reply_bytes)
        fence()
        w[W_MAGIC] = MAGIC

    def sleeping_any(self) -> bool:
        return bytes(self.sleeping) != self.awake  # a copy and a memcmp: ~0.1 µs

    def close(self) -> None:
        self.ring = None  # type: ignore[assignment]
        self.replies = []
        for view in (self.words, self.sleeping, self.reply_heads):
            view.release()
        with contextlib.suppress(BufferError):  # a caller still holds a view: GC unmaps
            self.mm.close()


class OwnedRing:
    """The writing end of a segment it creates: a memfd (no name in /dev/shm: the kernel
    frees it when the last process mapping it exits, even after kill -9) announced as
    ``pid fd size`` in ``DIR/ring`` of a private 0700 directory; a reader maps
    ``/proc/PID/fd/FD`` (:mod:`worker_side.ring`).  Writes steps, sees who sleeps."""

    def __init__(self, directory: Path, ring_bytes: int = DEFAULT_RING_BYTES,
                 reply_bytes: int = DEFAULT_REPLY_BYTES) -> None:
        if ring_bytes < MIN_BYTES or ring_bytes % 8 or reply_bytes < MIN_BYTES or reply_bytes % 8:
            raise ValueError(f"ring and reply sizes must be multiples of 8, at least {MIN_BYTES}")
        layout = Layout(ring_bytes, reply_bytes)
        self.fd = os.memfd_create("deltacast-ring", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, layout.size)
        self.seg = Segment(mmap.mmap(self.fd, layout.size), layout)
        self.seg.format()
        self.path = directory / RING_FILE
        self._bells: dict[int, int] = {}  # rank -> write end of its doorbell FIFO
        tmp = directory / f".{RING_FILE}.{os.getpid()}"
        tmp.write_text(f"{os.getpid()} {self.fd} {layout.size}\n")
        tmp.chmod(0o600)
        tmp.replace(self.path)  # atomically: a reader never reads a half-written file

    def publish(self, frames: Sequence[Any], seq: int, limit: int | None = None) -> bool:
        """Append one message; if it is too large (for the ring, or than ``limit``), an
        ON_PUB marker for ``seq`` instead (returns False: the caller MUST then send the
        message on its socket)."""
        if self.seg.ring.write(MESSAGE, pack_frames(frames), limit):
            return True
        self.seg.ring.write(ON_PUB, [_U64.pack(seq)])
        return False

    def sleepers(self) -> bool:
        """Whether a reader has announced it is blocking (send a doorbell; after a fence)."""
        fence()
        return self.seg.sleeping_any()

    def sleeping_ranks(self) -> list[int]:
        """Ranks whose reader announced it blocks (after a fence)."""
        fence()
        return [r for r, v in enumerate(self.seg.sleeping.cast("Q")) if v]

    def wake(self) -> None:
        """Ring the doorbell of each rank that announced it blocks: one byte into its FIFO
        ``DIR/bell.RANK`` (:func:`open_bell`).  The writer holds each FIFO open for
        reading too, so a write never meets a FIFO without a reader (no EPIPE, no
        SIGPIPE) when its rank is gone; a FIFO not made yet, or full, is skipped."""
        if not self.sleepers():  # (every step while the ranks spin: one memcmp)
            return
        for rank in self.sleeping_ranks():
            fd = self._bells.get(rank)
            if fd is None:
                try:
                    fd = self._bells[rank] = _open_fifo(
                        self.path.parent / BELL_FILE.format(rank), os.O_RDWR)
                except OSError:
                    continue  # (the rank re-checks the ring on its own)
            with contextlib.suppress(BlockingIOError):  # full: bells it has not read
                os.write(fd, b"\0")

    def close(self) -> None:
        """Mark the segment closed (attached readers re-attach) and remove ``DIR/ring``
        if it is still this one's.  Idempotent."""
        if self.fd < 0:
            return
        self.seg.words[W_CLOSED] = 1
        with contextlib.suppress(OSError):
            if self.path.read_text().split()[:2] == [str(os.getpid()), str(self.fd)]:
                self.path.unlink()
        self.seg.close()
        os.close(self.fd)
        self.fd = -1
        for fd in self._bells.values():
            os.close(fd)
        self._bells.clear()


def _open_fifo(path: Path, mode: int) -> int:
    """``path`` opened non-blocking (no symlink followed); OSError unless it is a FIFO."""
    fd = os.open(path, mode | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOFOLLOW)
    if not stat.S_ISFIFO(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{path} is not a FIFO")
    return fd


def open_bell(directory: Path, rank: int) -> int:
    """A rank's end of its doorbell: the FIFO ``DIR/bell.RANK``, made (0600) if missing,
    open for reading and writing, so it never reads end-of-file and polls readable only
    while a bell is unread (:func:`drain_bell`).  OSError if the path is not a FIFO."""
    path = directory / BELL_FILE.format(rank)
    with contextlib.suppress(FileExistsError):
        os.mkfifo(path, 0o600)
    return _open_fifo(path, os.O_RDWR)


def drain_bell(fd: int) -> None:
    """Read every unread bell (each only woke the rank)."""
    with contextlib.suppress(BlockingIOError):
        while os.read(fd, 4096):
            pass
