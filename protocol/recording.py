"""The recording file format of ``deltacast record``: typed frames, never pickle.

File format (all integers little-endian)::

    magic     16 bytes  b"DELTACAST-REC\\x00\\x02\\n" (format version 2 in byte 14; readers
                        take 1 too)
    header    u32 length + msgpack RecordHeader
    records   u8 kind, u16 frame count, then per frame u32 length + bytes

A record's frames are exactly what the vLLM adapter sends on that channel: an
``execute_model`` record is one Delta message (``codec.encode``).  Format 2 files may
hold grammar bitmasks by reference (``GrammarMsg.rows``, SPEC §16), which a format-1
reader would silently drop: it refuses them by their magic instead.  The reader checks
the magic first and raises :class:`NotARecording` for any other file: nothing in a
file is ever unpickled.  Pure (no vLLM): reports replay recordings without it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import msgspec

from protocol.errors import DECODE_ERRORS, IncompatibleVersion, LocalProtocolError
from protocol.messages import PROTOCOL_MAJOR

MAGIC_V1 = b"DELTACAST-REC\x00\x01\n"  # format 1: no grammar rows by reference
MAGIC = b"DELTACAST-REC\x00\x02\n"  # format 2, written
FORMAT = 2
_READABLE = (MAGIC_V1, MAGIC)
KINDS = {"execute_model": 1, "sample_tokens": 2, "reply": 3, "sample_reply": 4}
_NAMES = {v: k for k, v in KINDS.items()}


class RecordHeader(msgspec.Struct, frozen=True, omit_defaults=True):
    format: int = 1
    vllm_version: str = ""
    kv_groups: int = 1
    meta: dict[str, str] = msgspec.field(default_factory=dict)
    #: the protocol major the frames were made with (absent in files of protocol 1);
    #: its Deltas carry that major's digests, so another major cannot replay them
    protocol: int = 1


class NotARecording(LocalProtocolError):
    """The file is not a deltacast recording (or is truncated/corrupt)."""


class RecordWriter:
    """Appends typed frame records to a file (context manager)."""

    def __init__(self, path: str | Path, meta: dict[str, str] | None = None,
                 vllm_version: str = "", kv_groups: int = 1) -> None:
        self._f: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        header = msgspec.msgpack.encode(RecordHeader(FORMAT, vllm_version, kv_groups,
                                                     meta or {}, PROTOCOL_MAJOR))
        self._f.write(MAGIC + struct.pack("<I", len(header)) + header)

    def write(self, kind: str, frames: list[Any]) -> None:
        views = [memoryview(f).cast("B") for f in frames]
        parts: list[bytes | memoryview] = [struct.pack("<BH", KINDS[kind], len(views))]
        for v in views:
            parts += [struct.pack("<I", v.nbytes), v]
        self._f.write(b"".join(parts))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class RecordReader:
    """Iterates ``(kind, frames)`` of a recording; refuses anything else up front."""

    def __init__(self, path: str | Path) -> None:
        self.data = Path(path).read_bytes()
        if not self.data.startswith(_READABLE):
            raise NotARecording(f"{path} is not a deltacast recording (bad magic)",
                                starts_with=self.data[:8])
        n = self._unpack("<I", len(MAGIC))[0]
        start = len(MAGIC) + 4
        try:
            self.header = msgspec.msgpack.decode(self.data[start:start + n], type=RecordHeader)
        except DECODE_ERRORS as exc:
            raise NotARecording(f"{path}: corrupt header", cause=str(exc)) from exc
        if self.header.protocol != PROTOCOL_MAJOR:
            raise IncompatibleVersion(
                f"{path} was recorded with deltacast protocol {self.header.protocol}; this "
                f"version reads protocol {PROTOCOL_MAJOR} recordings: record it again",
                ours=PROTOCOL_MAJOR, theirs=self.header.protocol)
        self.meta = self.header.meta
        self._start = start + n

    def _unpack(self, fmt: str, pos: int) -> tuple[int, ...]:
        if pos + struct.calcsize(fmt) > len(self.data):
            raise NotARecording("recording is truncated", at=pos)
        return struct.unpack_from(fmt, self.data, pos)

    def __iter__(self) -> Iterator[tuple[str, list[memoryview]]]:
        view, pos = memoryview(self.data), self._start
        while pos < len(self.data):
            kind, count = self._unpack("<BH", pos)
            pos += 3
            frames = []
            for _ in range(count):
                (size,) = self._unpack("<I", pos)
                if pos + 4 + size > len(self.data):
                    raise NotARecording("recording is truncated", at=pos)
                frames.append(view[pos + 4:pos + 4 + size])
                pos += 4 + size
            if kind not in _NAMES:
                raise NotARecording("unknown record kind", kind=kind)
            yield _NAMES[kind], frames
