"""The writer side of the shared-memory object store (layout: protocol.store_handles).

``ShmStore`` owns one memfd data segment and one pin-table memfd per reader.
memfds have no name in /dev/shm, so nothing can leak there: the kernel frees a
segment when the last process mapping it exits, whether it exited cleanly or
was killed (Python's ``multiprocessing`` resource tracker is not involved).

Lifetimes.  An item may be evicted (its slot and bytes reused) only when
(a) no engine reference holds it (``put`` adds one, ``unref`` drops one: the
engine keeps a reference while a live request or encoder-cache entry needs it)
and (b) no live reader pins it.  ``refs_for`` pins an item for a reader
*before* returning its handle; the reader unpins on release.  A reader whose
process is gone is reaped: its pins are revoked.  Eviction is LRU among the
evictable items and happens only when an allocation does not fit.

Readers release an item only when the engine tells them to (the protocol's
deltas do), so a reader's pin table is an exact record of what it holds: an
item it holds travels as its bare key.

Not thread-safe: one writer thread.
"""

from __future__ import annotations

import bisect
import mmap
import os
import secrets
import select
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.errors import LocalProtocolError
from protocol.store_handles import (
    DIR_ENTRY,
    SECRET_BYTES,
    AttachInfo,
    ItemRef,
    PackedItem,
    StoreClosed,
    StoreFull,
    make_handle,
)

_PAGE = mmap.PAGESIZE


@dataclass
class _Entry:
    slot: int
    offset: int
    length: int
    generation: int
    refs: int = 1


@dataclass
class _Reader:
    pid: int
    pidfd: int
    pin_fd: int
    pin_map: mmap.mmap
    pins: np.ndarray[Any, np.dtype[np.uint64]]


class _FreeList:
    """Free extents of the data area, sorted by offset, coalesced on release."""

    def __init__(self, capacity: int) -> None:
        self.starts: list[int] = [0]
        self.sizes: list[int] = [capacity]

    def take(self, size: int) -> int | None:
        """First fit; the offset of ``size`` bytes, or None."""
        for i, free in enumerate(self.sizes):
            if free >= size:
                start = self.starts[i]
                if free == size:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += size
                    self.sizes[i] -= size
                return start
        return None

    def give(self, start: int, size: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.sizes.insert(i, size)
        if i + 1 < len(self.starts) and start + size == self.starts[i + 1]:
            self.sizes[i] += self.sizes.pop(i + 1)
            del self.starts[i + 1]
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:
            self.sizes[i - 1] += self.sizes.pop(i)
            del self.starts[i]


def _round(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _process_gone(pidfd: int) -> bool:
    readable, _, _ = select.select([pidfd], [], [], 0)
    return bool(readable)


class ShmStore:
    """Single-writer store of variable-size nested-tensor items keyed by content hash.

    Args:
        capacity: bytes of the data area (items are packed with 64-byte alignment).
        max_items: directory slots (bounds the number of resident items).
        populate: pre-fault the whole segment now (``MAP_POPULATE``) so that
            writing an item costs one memcpy and no page faults.
    """

    def __init__(self, capacity: int, *, max_items: int = 4096, populate: bool = False) -> None:
        if capacity <= 0 or max_items <= 0:
            raise LocalProtocolError("capacity and max_items must be positive")
        self.capacity = _round(capacity, 64)
        self.max_items = max_items
        self.data_start = _round(max_items * DIR_ENTRY, _PAGE)
        self._secret = secrets.token_bytes(SECRET_BYTES)
        self._fd = os.memfd_create("deltacast-store", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, self.data_start + self.capacity)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        self._map = mmap.mmap(self._fd, self.data_start + self.capacity, flags=flags)
        self._dir = np.frombuffer(self._map, np.uint64, max_items * 4).reshape(max_items, 4)
        self._data = memoryview(self._map)[self.data_start :]
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU order, oldest first
        self._free = _FreeList(self.capacity)
        self._free_slots = list(range(max_items - 1, -1, -1))
        self._readers: dict[int, _Reader] = {}
        self._next_reader = 0
        self._next_generation = 1
        self._closed = False
        self.evictions = 0

    # ------------------------------------------------------------ readers

    def add_reader(self, pid: int) -> AttachInfo:
        """Register reader process ``pid``; the result goes to it over a private channel."""
        self._check_open()
        pin_fd = os.memfd_create("deltacast-pins", os.MFD_CLOEXEC)
        os.ftruncate(pin_fd, self.max_items * 8)
        pin_map = mmap.mmap(pin_fd, self.max_items * 8)
        pins = np.frombuffer(pin_map, np.uint64)
        reader_id = self._next_reader
        self._next_reader += 1
        self._readers[reader_id] = _Reader(pid, os.pidfd_open(pid), pin_fd, pin_map, pins)
        return AttachInfo(os.getpid(), reader_id, self._fd, pin_fd, self.max_items,
                          self.data_start, self.capacity, self._secret)

    def remove_reader(self, reader_id: int) -> None:
        """Revoke every pin of ``reader_id`` (orderly detach, or its process died)."""
        reader = self._readers.pop(reader_id, None)
        if reader is None:
            return
        reader.pins[:] = 0
        del reader.pins
        reader.pin_map.close()
        os.close(reader.pin_fd)
        os.close(reader.pidfd)

    def reap(self) -> list[int]:
        """Remove readers whose process has exited; returns their ids."""
        gone = [rid for rid, r in self._readers.items() if _process_gone(r.pidfd)]
        for rid in gone:
            self.remove_reader(rid)
        return gone

    @property
    def readers(self) -> list[int]:
        return list(self._readers)

    # ------------------------------------------------------------ items

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, obj: Any) -> bool:
        """Add one engine reference to item ``key``, writing ``obj`` if it is absent.

        Writing is one copy of the tensor bytes.  Returns True if written.
        Raises :class:`StoreFull` if no room can be made (evictable items may
        have been evicted meanwhile; nothing else changes).
        """
        self._check_open()
        entry = self._entries.get(key)
        if entry is not None:
            entry.refs += 1
            self._entries.move_to_end(key)
            return False
        packed = PackedItem(obj)
        length = _round(max(packed.length, 1), 64)
        slot, offset = self._make_room(length)
        generation = self._next_generation
        self._next_generation += 1
        row = self._dir[slot]
        row[3] = 0  # "being written" before any byte changes
        packed.write_into(self._data[offset : offset + packed.length])
        row[0:3] = (offset, packed.length, len(packed.layout))
        row[3] = generation
        self._entries[key] = _Entry(slot, offset, length, generation)
        return True

    def unref(self, key: str) -> None:
        """Drop one engine reference; at zero the item becomes evictable once unpinned."""
        entry = self._entries.get(key)
        if entry is not None and entry.refs > 0:
            entry.refs -= 1

    def refs_for(self, reader_id: int, keys: Iterable[str]) -> list[ItemRef]:
        """What to send reader ``reader_id`` for ``keys``: bare keys for items it holds,
        handles (pinned for it from now on) for the others."""
        self._check_open()
        reader = self._readers.get(reader_id)
        if reader is None:
            raise LocalProtocolError("unknown reader", reader_id=reader_id)
        out: list[ItemRef] = []
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                raise LocalProtocolError("item not in store", key=key[:80])
            self._entries.move_to_end(key)
            if int(reader.pins[entry.slot]) == entry.generation:
                out.append(key)
                continue
            reader.pins[entry.slot] = entry.generation
            out.append(make_handle(self._secret, key, entry.slot, entry.generation))
        return out

    def holds(self, reader_id: int, key: str) -> bool:
        entry = self._entries.get(key)
        reader = self._readers.get(reader_id)
        return bool(entry and reader and int(reader.pins[entry.slot]) == entry.generation)

    def stats(self) -> dict[str, int]:
        used = sum(e.length for e in self._entries.values())
        return {"items": len(self._entries), "used_bytes": used, "evictions": self.evictions,
                "readers": len(self._readers), "capacity": self.capacity}

    # ------------------------------------------------------------ eviction

    def _pinned(self, entry: _Entry) -> bool:
        return any(int(r.pins[entry.slot]) == entry.generation for r in self._readers.values())

    def _victim(self) -> str | None:
        for key, entry in self._entries.items():  # oldest first
            if entry.refs == 0 and not self._pinned(entry):
                return key
        return None

    def _evict(self, key: str) -> None:
        entry = self._entries.pop(key)
        self._dir[entry.slot] = 0
        self._free.give(entry.offset, entry.length)
        self._free_slots.append(entry.slot)
        self.evictions += 1

    def _make_room(self, length: int) -> tuple[int, int]:
        """(slot, offset) for a new item, evicting LRU items as needed."""
        if length > self.capacity:
            raise StoreFull("item larger than the store", length=length, capacity=self.capacity)
        reaped = False
        while not self._free_slots or (offset := self._free.take(length)) is None:
            victim = self._victim()
            if victim is None and not reaped:
                reaped = True
                self.reap()
                continue
            if victim is None:
                raise StoreFull("every resident item is referenced or pinned", length=length)
            self._evict(victim)
        return self._free_slots.pop(), offset

    # ------------------------------------------------------------ lifetime

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("store is closed")

    def close(self) -> None:
        """Revoke all readers and unmap; the memory is freed once readers unmap too."""
        if self._closed:
            return
        self._closed = True
        for rid in list(self._readers):
            self.remove_reader(rid)
        self._entries.clear()
        del self._dir
        self._data.release()
        self._map.close()
        os.close(self._fd)

    def __enter__(self) -> ShmStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
