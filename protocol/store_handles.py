"""Shared-memory object store: layout, handles and their errors (pure; no OS resources).

Theory of operation (the writer is ``engine_side.shm_store``, readers are
``worker_side.shm_reader``):

* One **data segment** (a memfd) holds a directory of ``max_items`` slots and a
  data area of variable-size items.  Readers map it read-only.  Directory slot
  ``s`` is four little-endian u64: ``offset`` (into the data area), ``length``,
  ``layout_len`` and ``generation``; generation 0 means "empty / being written".
* An **item** is a nested structure of tensors written with one copy::

      [tensor 0][pad to 64][tensor 1][pad] ... [layout]

  The layout (:class:`ItemLayout`, msgpack) is the skeleton: the msgpack body of
  the structure with every tensor replaced by a :mod:`protocol.tensors` Ext
  (dtype, shape, frame index), plus each frame's offset and size inside the
  item.  Readers rebuild the structure as views over the mapping: zero copies.
* Every reader has its own **pin table** (a small writable memfd): u64 slot
  ``s`` equals the slot's generation while that reader holds the item.  The
  writer sets the pin *before* it sends a handle and never reuses a slot or
  its bytes while any live reader pins it; the reader clears the pin when it
  releases the item.  When a reader process dies the writer revokes its table.
* A **handle** is ``(key, slot, generation, mac)``; ``mac`` is a truncated
  HMAC-SHA256 of (key, slot, generation) under a per-run secret that readers
  get only when they attach.  Generations grow for the whole run and are never
  reused, so a stale handle cannot silently resolve to another item: readers
  refuse it with :class:`StaleHandle`, and a forged one with :class:`ForgedHandle`.
* On the control channel an item travels as its handle the first time a reader
  needs it, and as its bare key (the multimodal hash) while the reader holds it.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.errors import (
    DECODE_ERRORS,
    LocalProtocolError,
    MalformedMessage,
    ProtocolError,
    RemoteProtocolError,
    malformed,
)
from protocol.tensors import make_enc_hook, make_ext_hook

ALIGN = 64  # every tensor frame starts on a 64-byte boundary inside its item
DIR_ENTRY = 32  # bytes per directory slot: offset, length, layout_len, generation
MAC_BYTES = 16
SECRET_BYTES = 32


# ---------------------------------------------------------------- errors


class ForgedHandle(RemoteProtocolError):
    """A handle whose MAC does not verify under this run's secret."""


class StaleHandle(RemoteProtocolError):
    """A genuine handle whose item is gone (evicted, replaced) or not pinned for us."""


class UnknownItem(RemoteProtocolError):
    """A bare key for an item this reader does not hold."""


class StoreFull(LocalProtocolError):
    """No room for an item even after evicting every unpinned, unreferenced item."""


class StoreClosed(LocalProtocolError):
    """The store (or reader) was used after ``close()``."""


# ---------------------------------------------------------------- wire structs


class ItemHandle(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Reference to one item in the store, valid for one reader while it is pinned."""

    key: str
    slot: int
    generation: int
    mac: bytes


#: What the control channel carries per item: a handle, or the bare key of an
#: item the receiving reader already holds (a cache hit moves only the key).
ItemRef = ItemHandle | str

_REFS_ENCODER = msgspec.msgpack.Encoder()
_REFS_DECODER = msgspec.msgpack.Decoder(list[ItemHandle | str])


def encode_refs(refs: Sequence[ItemRef]) -> bytes:
    return _REFS_ENCODER.encode(list(refs))


def decode_refs(data: Any) -> list[ItemRef]:
    """Decode a refs message; anything invalid raises :class:`MalformedMessage`."""
    try:
        return _REFS_DECODER.decode(data)
    except DECODE_ERRORS as exc:
        raise malformed("bad store refs", exc) from exc


class AttachInfo(msgspec.Struct, frozen=True):
    """Everything a local reader needs to attach (sent over a private channel only).

    ``data_fd`` / ``pin_fd`` are the writer's descriptors; a reader opens them as
    ``/proc/<writer_pid>/fd/<n>`` (or receives them by SCM_RIGHTS / inheritance).
    """

    writer_pid: int
    reader_id: int
    data_fd: int
    pin_fd: int
    max_items: int
    data_start: int
    capacity: int
    secret: bytes


# ---------------------------------------------------------------- MACs


def sign(secret: bytes, key: str, slot: int, generation: int) -> bytes:
    payload = struct.pack("<IQ", slot, generation) + key.encode("utf-8")
    return hmac.new(secret, payload, hashlib.sha256).digest()[:MAC_BYTES]


def make_handle(secret: bytes, key: str, slot: int, generation: int) -> ItemHandle:
    return ItemHandle(key, slot, generation, sign(secret, key, slot, generation))


def verify(secret: bytes, handle: ItemHandle, max_items: int) -> None:
    """Raise :class:`ForgedHandle` unless ``handle`` was issued under ``secret``."""
    if not (0 <= handle.slot < max_items and 0 < handle.generation < 2**64):
        raise ForgedHandle("handle out of range", slot=handle.slot, gen=handle.generation)
    expected = sign(secret, handle.key, handle.slot, handle.generation)
    if not hmac.compare_digest(expected, handle.mac):
        raise ForgedHandle("handle MAC does not verify", key=handle.key[:80])


# ---------------------------------------------------------------- item layout


class ItemLayout(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Skeleton of one item: msgpack body (tensors as Exts) + frame placement."""

    body: bytes
    offsets: list[int]
    sizes: list[int]


_LAYOUT_DECODER = msgspec.msgpack.Decoder(ItemLayout)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class PackedItem:
    """An item ready to be copied into the store: frames alias the caller's tensors."""

    __slots__ = ("frames", "layout", "length", "offsets")

    def __init__(self, obj: Any) -> None:
        aux: list[Any] = []
        body = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode(obj)
        self.frames: list[memoryview] = [memoryview(f).cast("B") for f in aux]
        self.offsets: list[int] = []
        end = 0
        for frame in self.frames:
            end = align(end)
            self.offsets.append(end)
            end += frame.nbytes
        sizes = [f.nbytes for f in self.frames]
        self.layout = msgspec.msgpack.encode(ItemLayout(body, self.offsets, sizes))
        self.length = end + len(self.layout)

    def write_into(self, dest: memoryview) -> None:
        """Copy the item into ``dest`` (exactly ``self.length`` bytes): one copy."""
        for offset, frame in zip(self.offsets, self.frames, strict=True):
            dest[offset : offset + frame.nbytes] = frame
        dest[self.length - len(self.layout) :] = self.layout


def unpack_item(item: memoryview, layout_len: int) -> Any:
    """Rebuild the structure over ``item``; tensors are views (read-only if it is)."""
    if not 0 < layout_len <= item.nbytes:
        raise MalformedMessage("bad item layout length", layout_len=layout_len)
    try:
        layout = _LAYOUT_DECODER.decode(item[item.nbytes - layout_len :])
    except DECODE_ERRORS as exc:
        raise malformed("bad item layout", exc) from exc
    limit = item.nbytes - layout_len
    frames = []
    for offset, size in zip(layout.offsets, layout.sizes, strict=False):
        if offset < 0 or size < 0 or offset + size > limit:
            raise MalformedMessage("item frame out of bounds", offset=offset, size=size)
        frames.append(item[offset : offset + size])
    decoder = msgspec.msgpack.Decoder(ext_hook=make_ext_hook(frames))
    try:
        return decoder.decode(layout.body)
    except ProtocolError:
        raise
    except DECODE_ERRORS as exc:
        raise malformed("bad item body", exc) from exc
