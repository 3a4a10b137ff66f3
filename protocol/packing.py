"""Bit-packed unsigned integer arrays.

Token ids, block ids and handles travel as the number of bits their largest
value needs, not as msgpack lists of ints.  Wire layout of one packed array::

    byte 0      width in bits (0..64); 0 means "every value is zero"
    bytes 1..k  element count, unsigned LEB128
    rest        ceil(count * width / 8) bytes, values little-endian bit order

Signed values are zig-zag mapped by :func:`pack_sints` first.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from protocol import kernels
from protocol.errors import MalformedMessage

_MAX_WIDTH = 64
INT64_MAX = (1 << 63) - 1  # the largest value an int64 column or packed array holds
_EMPTY = np.zeros(0, dtype=np.int64)
_INT = {int}  # the element type of a list packed without numpy (bool is not int here)


def leb128(value: int) -> bytes:
    """Unsigned LEB128 (little-endian base-128 varint) of a non-negative int."""
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def read_leb128(buf: bytes | memoryview, pos: int, what: str = "packed array") -> tuple[int, int]:
    """Read one canonical varint < 2**63 at ``pos``; return (value, next position).

    Raises MalformedMessage for a truncated, overlong or non-canonical varint.
    """
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 56:
            raise MalformedMessage(f"truncated or overlong varint in {what}")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            if byte == 0 and shift > 7:
                raise MalformedMessage(f"non-canonical varint in {what}")
            return value, pos


# Lists up to this long are unpacked with Python ints (no numpy call), and packed up to
# PACK_SMALL (one LEB128 count byte); measured crossovers with numpy: ~100 and ~200 items.
SMALL = 64
PACK_SMALL = 127


def _pack_list(values: list[int]) -> bytes | None:
    """:func:`pack_uints` of a short list of Python ints (None: not such a list)."""
    if not values:
        return b"\x00\x00"
    if min(values) < 0:
        raise ValueError("pack_uints takes non-negative values; use pack_sints")
    width = max(values).bit_length()
    if width > _MAX_WIDTH:
        return None
    head = bytes((width, len(values)))  # one LEB128 byte: len(values) <= PACK_SMALL < 128
    if width == 0:
        return head
    acc = 0
    for v in reversed(values):  # value i at bits i*width.. (little-endian bit order)
        acc = (acc << width) | v
    return head + acc.to_bytes((len(values) * width + 7) // 8, "little")


def _pack_short(values: list[int]) -> bytes | None:
    """:func:`_pack_list` of a short list, in C when the kernels are built (None:
    the C version does not take it -- a negative or huge value -- so Python decides)."""
    packed = kernels.pack_list(values)
    return packed if packed is not None else _pack_list(values)


def pack_uints(values: npt.ArrayLike) -> bytes:
    """Pack non-negative integers at the minimal common bit width."""
    if type(values) is list:
        packed = kernels.pack_list(values)  # any length
        if packed is None and len(values) <= PACK_SMALL and set(map(type, values)) <= _INT:
            packed = _pack_list(values)
        if packed is not None:
            return packed
    elif type(values) is np.ndarray and values.dtype.kind in "iu":
        if values.size <= PACK_SMALL:
            packed = _pack_short(values.ravel().tolist())  # Python ints beat numpy's fixed costs
        elif kernels.NATIVE and values.dtype != np.uint64:  # (uint64 may not fit int64)
            packed = kernels.pack_array(np.ascontiguousarray(values, dtype=np.int64).ravel())
        else:
            packed = None
        if packed is not None:  # None: a negative value, or no C kernels
            return packed
    arr = np.asarray(values)
    if arr.size and arr.min() < 0:
        raise ValueError("pack_uints takes non-negative values; use pack_sints")
    arr = arr.astype(np.uint64, copy=False).ravel()
    width = int(arr.max()).bit_length() if arr.size else 0
    head = bytes([width]) + leb128(arr.size)
    if width == 0:
        return head
    if width in (8, 16, 32, 64):
        return head + arr.astype(f"<u{width // 8}").tobytes()
    shifts = np.arange(width, dtype=np.uint64)
    bits = ((arr[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return head + np.packbits(bits.ravel(), bitorder="little").tobytes()


def pack_row_counts(counts: list[int] | npt.NDArray[np.int64]) -> bytes:
    """A ``Rows.counts`` field: empty when every row holds exactly one value (the
    meaning of empty counts), else :func:`pack_uints`."""
    if type(counts) is list:
        return b"" if counts.count(1) == len(counts) else pack_uints(counts)
    return b"" if bool(np.all(np.asarray(counts) == 1)) else pack_uints(counts)


def unpack_uints(buf: bytes, *, limit: int = 1 << 26) -> npt.NDArray[np.int64]:
    """Inverse of :func:`pack_uints`; returns a fresh int64 array.

    Raises MalformedMessage for a truncated buffer, a bad width, a value that does
    not fit int64, or a count over ``limit`` (a guard against a hostile count
    allocating unbounded memory).
    """
    short = _raw_list(buf)
    if short is not None:
        if short and buf[0] == 64 and max(short) > INT64_MAX:
            raise MalformedMessage("packed value does not fit int64")
        return np.array(short, dtype=np.int64)
    native = kernels.unpack_array(buf, limit)  # one pass (None: malformed, or past int64)
    if native is not None:
        return np.frombuffer(native, dtype=np.int64)
    raw = _unpack_raw(buf, limit)
    if raw.dtype == np.uint64 and raw.size and int(raw.max()) > INT64_MAX:
        raise MalformedMessage("packed value does not fit int64")
    return raw.astype(np.int64)


def _raw_list(buf: bytes) -> list[int] | None:
    """The raw values of a short packed array as Python ints (None: not short)."""
    if len(buf) >= 2 and buf[1] <= SMALL:
        out = kernels.raw_list(buf, SMALL)
        if out is not None:
            return out
    return _raw_list_py(buf)  # not taken, or malformed: Python decides and raises


def _raw_list_py(buf: bytes) -> list[int] | None:
    """:func:`_raw_list` without the C kernels (the reference)."""
    if len(buf) < 2 or buf[1] > SMALL or buf[0] > _MAX_WIDTH:
        return None
    width, count = buf[0], buf[1]
    need = (count * width + 7) // 8
    if len(buf) - 2 != need:
        raise MalformedMessage("packed array length mismatch", expected=need, got=len(buf) - 2)
    if width == 0:
        return [0] * count
    acc, mask = int.from_bytes(buf[2:], "little"), (1 << width) - 1
    if count == 1:  # the common single value (a row's handle or block)
        return [acc & mask]
    return [(acc >> (i * width)) & mask for i in range(count)]


def unpack_uint_list(buf: bytes, *, limit: int = 1 << 26) -> list[int]:
    """:func:`unpack_uints` as a list of Python ints (short arrays without numpy)."""
    out = kernels.raw_list(buf, limit)  # any length, or None
    if out is None:
        out = _raw_list_py(buf)
    if out is None:
        return unpack_uints(buf, limit=limit).tolist()  # type: ignore[no-any-return]
    if out and buf[0] == 64 and max(out) > INT64_MAX:
        raise MalformedMessage("packed value does not fit int64")
    return out


def _unpack_raw(buf: bytes, limit: int) -> npt.NDArray[np.uint64] | npt.NDArray[np.int64]:
    if not buf:
        raise MalformedMessage("empty packed array")
    width = buf[0]
    count, pos = read_leb128(buf, 1)
    if width > _MAX_WIDTH or count > limit:
        raise MalformedMessage("packed array out of bounds", width=width, count=count)
    payload = memoryview(buf)[pos:]
    if width == 0:
        if len(payload):
            raise MalformedMessage("trailing bytes after zero-width array")
        return np.zeros(count, dtype=np.int64)
    need = (count * width + 7) // 8
    if len(payload) != need:
        raise MalformedMessage("packed array length mismatch", expected=need, got=len(payload))
    if width in (8, 16, 32, 64):
        return np.frombuffer(payload, dtype=f"<u{width // 8}").astype(np.uint64)
    flat = np.unpackbits(np.frombuffer(payload, dtype=np.uint8), bitorder="little")
    bits = flat[: count * width].reshape(count, width).astype(np.int64)
    return bits @ (np.int64(1) << np.arange(width, dtype=np.int64))


def pack_sints(values: npt.ArrayLike) -> bytes:
    """Pack signed integers (zig-zag mapped) at the minimal bit width."""
    if type(values) is list:
        packed = kernels.pack_signed_list(values)  # any length
        if packed is not None:
            return packed
        if len(values) <= PACK_SMALL and all(
                type(v) is int and -INT64_MAX - 1 <= v <= INT64_MAX for v in values):
            return pack_uints([v << 1 if v >= 0 else (-v << 1) - 1 for v in values])
    arr = np.asarray(values, dtype=np.int64).ravel()
    return pack_uints(((arr << 1) ^ (arr >> 63)).view(np.uint64))


def unpack_sints(buf: bytes) -> npt.NDArray[np.int64]:
    """Inverse of :func:`pack_sints`."""
    short = _raw_list(buf)
    if short is None:
        return _unpack_sints(buf)
    return np.array([v >> 1 if not v & 1 else -(v >> 1) - 1 for v in short], dtype=np.int64)


def unpack_sint_list(buf: bytes) -> list[int]:
    """:func:`unpack_sints` as a list of Python ints."""
    out = kernels.raw_signed_list(buf, 1 << 26)  # any length, or None
    if out is not None:
        return out
    raw = _raw_list_py(buf)
    if raw is None:
        return _unpack_sints(buf).tolist()  # type: ignore[no-any-return]
    return [v >> 1 if not v & 1 else -(v >> 1) - 1 for v in raw]


def _unpack_sints(buf: bytes) -> npt.NDArray[np.int64]:
    z = _unpack_raw(buf, 1 << 26).astype(np.uint64)
    return ((z >> np.uint64(1)).view(np.int64)) ^ -((z & np.uint64(1)).view(np.int64))
