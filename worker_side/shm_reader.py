"""The reader side of the shared-memory object store (layout: protocol.store_handles).

A worker attaches with the :class:`AttachInfo` its engine sent over a private
channel, then turns the item refs it receives on the control channel into
nested structures whose tensors are views over the read-only mapping: no copy,
whatever the item size.

Contract:

* A handle is checked before any byte is read: its MAC (else
  :class:`ForgedHandle`), then this reader's pin and the directory generation
  (else :class:`StaleHandle`).  A bare key must name an item this reader holds
  (else :class:`UnknownItem`).
* Returned tensors stay valid until ``release(key)`` / ``close()``; using them
  afterwards reads whatever the writer stored there since.  They are
  read-only: numpy marks them so; writing into a torch view faults (SIGSEGV).
* Release only when the engine says so (see engine_side.shm_store).  If this
  process dies, the engine reaps it and revokes its pins.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import Any

import numpy as np

from protocol.errors import MalformedMessage
from protocol.store_handles import (
    AttachInfo,
    ItemHandle,
    ItemRef,
    StaleHandle,
    StoreClosed,
    UnknownItem,
    unpack_item,
    verify,
)


def _open_peer_fd(pid: int, fd: int, flags: int) -> int:
    """Open another process's descriptor (same user) as a new file description."""
    return os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_CLOEXEC)


class ShmReader:
    """One worker's read-only view of the engine's store, plus its pin table."""

    def __init__(self, info: AttachInfo, data_fd: int, pin_fd: int) -> None:
        """Map the store from descriptors this process owns (they are not closed)."""
        self.info = info
        self._map = mmap.mmap(data_fd, info.data_start + info.capacity, prot=mmap.PROT_READ)
        self._pin_map = mmap.mmap(pin_fd, info.max_items * 8)
        self._dir = np.frombuffer(self._map, np.uint64, info.max_items * 4).reshape(-1, 4)
        self._pins = np.frombuffer(self._pin_map, np.uint64)
        self._data = memoryview(self._map)[info.data_start :]
        self._held: dict[str, tuple[int, int, Any]] = {}  # key -> (slot, generation, obj)
        self._closed = False

    @classmethod
    def attach(cls, info: AttachInfo) -> ShmReader:
        """Attach through ``/proc/<writer_pid>/fd`` (the writer must be alive)."""
        data_fd = _open_peer_fd(info.writer_pid, info.data_fd, os.O_RDONLY)
        try:
            pin_fd = _open_peer_fd(info.writer_pid, info.pin_fd, os.O_RDWR)
            try:
                return cls(info, data_fd, pin_fd)
            finally:
                os.close(pin_fd)  # the mappings keep the memfds alive
        finally:
            os.close(data_fd)

    # ------------------------------------------------------------ reading

    def resolve(self, ref: ItemRef) -> Any:
        """The structure behind ``ref`` (tensors are views); the item is then held."""
        if self._closed:
            raise StoreClosed("reader is closed")
        if isinstance(ref, str):
            held = self._held.get(ref)
            if held is None:
                raise UnknownItem("bare key for an item this reader does not hold", key=ref[:80])
            return held[2]
        return self._resolve_handle(ref)

    def resolve_all(self, refs: list[ItemRef]) -> list[Any]:
        return [self.resolve(ref) for ref in refs]

    def _resolve_handle(self, handle: ItemHandle) -> Any:
        verify(self.info.secret, handle, self.info.max_items)
        held = self._held.get(handle.key)
        if held is not None and held[:2] == (handle.slot, handle.generation):
            return held[2]
        slot, generation = handle.slot, handle.generation
        if int(self._pins[slot]) != generation:
            raise StaleHandle("item is not pinned for this reader", key=handle.key[:80])
        offset, length, layout_len, current = (int(v) for v in self._dir[slot])
        if current != generation:
            raise StaleHandle("item was replaced", key=handle.key[:80], generation=current)
        if offset + length > self.info.capacity:
            raise MalformedMessage("directory entry out of bounds", slot=slot)
        obj = unpack_item(self._data[offset : offset + length], layout_len)
        if held is not None:  # an older copy of the same content: let it go
            self._unpin(held[0], held[1])
        self._held[handle.key] = (slot, generation, obj)
        return obj

    # ------------------------------------------------------------ lifetime

    def holds(self, key: str) -> bool:
        return key in self._held

    @property
    def held_keys(self) -> list[str]:
        return list(self._held)

    def _unpin(self, slot: int, generation: int) -> None:
        if int(self._pins[slot]) == generation:
            self._pins[slot] = 0

    def forget(self, key: str) -> None:
        """Undo the first resolve of ``key`` (a step refused after it): the item stays
        pinned for this reader, so its handle resolves again; views already handed out
        must not be used."""
        self._held.pop(key, None)

    def release(self, key: str) -> None:
        """Stop holding ``key``: its views must not be used any more."""
        held = self._held.pop(key, None)
        if held is not None and not self._closed:
            self._unpin(held[0], held[1])

    def close(self) -> None:
        """Release everything and unmap (deferred to GC while caller views remain)."""
        if self._closed:
            return
        for key in list(self._held):
            self.release(key)
        self._closed = True
        del self._dir, self._pins
        self._data.release()
        for m in (self._map, self._pin_map):
            with contextlib.suppress(BufferError):  # caller views: unmapped when they die
                m.close()

    def __enter__(self) -> ShmReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

