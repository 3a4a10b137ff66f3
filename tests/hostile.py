"""Hostile frames for the test_hostile_* modules: real frames mutated one way, values
nested past the interpreter's recursion limit, and the one check every decoder must
pass -- a value or a ProtocolError subclass, nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hypothesis import event
from hypothesis import strategies as st

from protocol.errors import ProtocolError

GOLDEN = Path(__file__).parent / "golden"
DEEP = 1000  # values nested this deep exceed the recursion limit (1000) inside msgspec
SECRET = b"h" * 32


def golden() -> dict[str, list[bytes]]:
    """The golden fixtures' frames by name."""
    return {p.stem: [bytes.fromhex(line) for line in p.read_text().split()]
            for p in sorted(GOLDEN.glob("*.hex"))}


def nested(depth: int) -> bytes:
    """A msgpack value nested ``depth`` arrays deep: ``[[[...nil...]]]``."""
    return b"\x91" * depth + b"\xc0"


def with_nested_field(frame: bytes, depth: int = DEEP) -> bytes | None:
    """``frame`` (a msgpack array or map at the top) with one more element: a value
    nested ``depth`` deep (under the key "zz" for a map); None for another frame.  A
    decoder skips an unknown trailing field -- and msgspec recurses to skip it."""
    if not frame:
        return None
    head, rest, value = frame[0], frame[1:], nested(depth)
    if head & 0xF0 == 0x90 and head != 0x9F:  # fixarray of up to 14
        return bytes([head + 1]) + rest + value
    if head & 0xF0 == 0x80 and head != 0x8F:  # fixmap of up to 14
        return bytes([head + 1]) + rest + b"\xa2zz" + value
    if head in (0xDC, 0xDE) and len(frame) >= 3 and frame[1:3] != b"\xff\xff":  # 16-bit
        n = int.from_bytes(frame[1:3], "big") + 1
        return bytes([head]) + n.to_bytes(2, "big") + frame[3:] + \
            (b"\xa2zz" if head == 0xDE else b"") + value
    return None


@st.composite
def mutated(draw: Any, seeds: list[list[bytes]]) -> list[bytes]:
    """One of ``seeds`` (lists of frames) mutated one way."""
    frames = list(draw(st.sampled_from(seeds)))
    k = draw(st.integers(0, len(frames) - 1))
    raw = bytearray(frames[k])
    how = draw(st.sampled_from(["flip", "byte", "cut", "insert", "nest_tail", "nest_at",
                                "drop_frame", "dup_frame"]))
    event(how)
    if how == "nest_tail":
        frames[k] = with_nested_field(frames[k], draw(st.sampled_from([DEEP, 5000]))) or b""
        return frames
    if how == "drop_frame":
        return frames[:k] + frames[k + 1:]
    if how == "dup_frame":
        return frames[:k + 1] + frames[k:]
    i = draw(st.integers(0, max(len(raw) - 1, 0)))
    if how == "flip" and raw:
        raw[i] ^= 1 << draw(st.integers(0, 7))
    elif how == "byte" and raw:
        raw[i] = draw(st.integers(0, 255))
    elif how == "cut":
        del raw[i:]
    elif how == "nest_at":  # (a JSON frame nests in brackets)
        depth = draw(st.sampled_from([1, 30, DEEP, 5000]))
        raw[i:i] = b"[" * depth if raw[:1] == b"{" else nested(depth)
    else:
        raw.insert(i, draw(st.integers(0, 255)))
    frames[k] = bytes(raw)
    return frames


def typed(decode: Callable[[list[bytes]], Any], frames: list[bytes]) -> Any:
    """Decode ``frames``: a value (returned) or a ProtocolError (None); anything else
    fails the test."""
    try:
        got = decode(frames)
    except ProtocolError as exc:
        event(type(exc).__name__)
        return None
    event("decoded")
    return got


def one(frames: list[bytes]) -> bytes:
    """The frame of a single-frame input (a mutation may have dropped it)."""
    return frames[0] if frames else b""
