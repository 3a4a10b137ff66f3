"""How the fuzz campaign (:mod:`engine_side.bench.fuzz`) makes its cases.

* :func:`mutate`: one real message (a list of frames) changed one way -- bytes (flips,
  set, insert, delete, cut, duplicate, splice from another seed, a value nested past
  the recursion limit), frames (drop, duplicate, swap, add), or its *structure*: the
  first frame decoded as generic msgpack, one node of the tree changed (integers to
  their boundaries, strings and byte strings cut, grown or retyped, arrays and maps
  emptied, shuffled, grown, nested deep, unknown keys added) and encoded again, so the
  result still gets past the header into the typed decoders and the state checks.
* :func:`message_strategy`: Hypothesis strategies over the wire types (every Struct
  of :mod:`protocol.messages` and :class:`protocol.replies.StepResult`), drawn from the
  field annotations: well-typed messages with hostile values.
"""

from __future__ import annotations

import random
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from protocol.packing import pack_uints

Frames = list[bytes]
DEEP = 1000  # nesting past the interpreter's recursion limit inside msgspec

INTS = (0, 1, -1, 2, 7, 127, 128, 255, 256, 65535, 65536, (1 << 24), (1 << 24) + 1,
        (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32, (1 << 62) - 1, 1 << 62,
        (1 << 63) - 1, -(1 << 63), (1 << 64) - 1, -(1 << 31), -2)


def nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"


# ---------------------------------------------------------------- byte and frame level
def _bytes(rng: random.Random, raw: bytearray, other: bytes) -> str:
    how = rng.randrange(10)
    n = len(raw)
    i = rng.randrange(n) if n else 0
    if how == 0 and n:
        raw[i] ^= 1 << rng.randrange(8)
        return "flip"
    if how == 1 and n:
        raw[i] = rng.choice((0, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xDC, 0xDE, rng.randrange(256)))
        return "byte"
    if how == 2:
        raw[i:i] = bytes(rng.randrange(256) for _ in range(rng.choice((1, 1, 2, 4, 9))))
        return "insert"
    if how == 3 and n > 1:
        del raw[i:i + rng.choice((1, 2, 4, 16, n))]
        return "delete"
    if how == 4 and n > 1:
        del raw[max(1, i):]
        return "cut"
    if how == 5 and n:
        j = rng.randrange(i, n)
        raw[j:j] = raw[i:j + 1]
        return "duplicate"
    if how == 6 and other:
        a = rng.randrange(len(other))
        raw[i:i + rng.randrange(1, 32)] = other[a:a + rng.randrange(1, 64)]
        return "splice"
    if how == 7:
        depth = rng.choice((1, 30, DEEP, 5000))  # (JSON nests in brackets)
        raw[i:i] = b"[" * depth if raw[:1] == b"{" else nested(depth)
        return "nest_at"
    if how == 8 and n:  # a multi-byte field: a run of bytes rewritten
        for k in range(i, min(n, i + rng.choice((2, 4, 8)))):
            raw[k] = rng.randrange(256)
        return "run"
    raw += bytes(rng.randrange(256) for _ in range(rng.choice((1, 8, 100))))
    return "append"


def _frames(rng: random.Random, frames: Frames) -> str:
    how = rng.randrange(4)
    k = rng.randrange(len(frames))
    if how == 0:
        del frames[k]
        return "drop_frame"
    if how == 1:
        frames.insert(k, frames[k])
        return "dup_frame"
    if how == 2 and len(frames) > 1:
        j = rng.randrange(len(frames))
        frames[k], frames[j] = frames[j], frames[k]
        return "swap_frames"
    frames.append(rng.choice((b"", b"\x00" * 16, bytes(8))))
    return "add_frame"


# ---------------------------------------------------------------- structure level
def _nodes(tree: Any, path: tuple[Any, ...], out: list[tuple[Any, ...]], cap: int) -> None:
    """The paths of ``tree``'s nodes, depth first, at most ``cap`` (iterative: a mutated
    tree may nest deeper than Python's recursion limit)."""
    stack = [(tree, path)]
    while stack and len(out) < cap:
        node, at = stack.pop()
        out.append(at)
        if isinstance(node, list):
            stack.extend((v, (*at, i)) for i, v in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            stack.extend((v, (*at, k)) for k, v in reversed(list(node.items())))


def _new_value(rng: random.Random, old: Any) -> Any:
    """A replacement for ``old``: mostly of its type at its edges, sometimes retyped."""
    if rng.random() < 0.15:  # retyped
        return rng.choice((None, True, 0, -1, (1 << 64) - 1, "", "x" * 40, b"", [], {},
                           [[[]]], 1.5, msgspec.msgpack.Ext(7, b"\x00" * 8)))
    if isinstance(old, bool):
        return not old
    if isinstance(old, int):
        return rng.choice((*INTS, old + 1, old - 1, old * 2, -old, rng.randrange(-1000, 1000)))
    if isinstance(old, str):
        return rng.choice(("", old[:-1], old + old, "\x00", "é" * 3, old + "x", "r0"))
    if isinstance(old, bytes | bytearray):
        b = bytearray(old)
        if b and rng.random() < 0.5:  # a packed array's header: width and count
            b[0] = rng.choice((0, 1, 8, 31, 32, 63, 64, 65, 255))
        else:
            _bytes(rng, b, b"")
        if rng.random() < 0.3:
            return pack_uints([rng.choice((0, 1, 7, 255, 65536, (1 << 31) - 1, (1 << 63) - 1))
                               for _ in range(rng.randrange(6))])
        return bytes(b)
    if isinstance(old, list):
        v = list(old)
        how = rng.randrange(5)
        if how == 0 or not v:
            return [] if v else [rng.choice((0, "", b"", None, []))]
        if how == 1:
            return v + v
        if how == 2:
            rng.shuffle(v)
            return v
        if how == 3:
            return v[:-1]
        return [v]  # one level deeper
    if isinstance(old, dict):
        d = dict(old)
        how = rng.randrange(4)
        if how == 0 and d:
            d.pop(rng.choice(list(d)))
        elif how == 1:
            d[rng.choice(("zz", "x", "h", "a", "r", "s", "nt", "0"))] = rng.choice(
                (0, "", b"", [], {}, nested(3)))
        elif how == 2:
            return {}
        else:
            d["zz"] = msgspec.Raw(nested(DEEP)) if rng.random() < 0.3 else [d]
        return d
    return rng.choice((0, "", b"", None))


def _set(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


def _structure(rng: random.Random, frames: Frames) -> str:
    k = 0 if rng.random() < 0.8 else rng.randrange(len(frames))
    try:
        tree = msgspec.msgpack.decode(frames[k])
    except (msgspec.DecodeError, ValueError, RecursionError):
        return _bytes_at(rng, frames, k)
    paths: list[tuple[Any, ...]] = []
    _nodes(tree, (), paths, 4096)
    path = rng.choice(paths[1:] or paths)
    node = tree
    for key in path:
        node = node[key]
    if path and isinstance(path[-1], str) and rng.random() < 0.1:  # rename a map key
        parent = tree
        for key in path[:-1]:
            parent = parent[key]
        parent[rng.choice(("zz", path[-1] + "x", ""))] = parent.pop(path[-1])
        how = "rename_key"
    else:
        tree = _set(tree, path, _new_value(rng, node))
        how = f"node_{type(node).__name__}"
    try:
        frames[k] = msgspec.msgpack.encode(tree)
    except (TypeError, OverflowError, ValueError, RecursionError):
        return _bytes_at(rng, frames, k)
    return how


def _bytes_at(rng: random.Random, frames: Frames, k: int, other: bytes = b"") -> str:
    raw = bytearray(frames[k])
    how = _bytes(rng, raw, other)
    frames[k] = bytes(raw)
    return how


def mutate(rng: random.Random, seed: Frames, other: bytes = b"") -> tuple[Frames, str]:
    """``seed`` changed one to three ways (see the module docstring); the last way's name."""
    frames = list(seed) or [b""]
    how = "none"
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        r = rng.random()
        if r < 0.45:
            how = _structure(rng, frames)
        elif r < 0.9 or len(frames) == 0:
            how = _bytes_at(rng, frames, rng.randrange(len(frames)), other)
        else:
            how = _frames(rng, frames)
        if not frames:
            frames = [b""]
    return frames, how


# ---------------------------------------------------------------- Hypothesis strategies
def message_strategy(types: tuple[type, ...]) -> Any:
    """A Hypothesis strategy over instances of the Struct ``types``, field by field."""
    from hypothesis import strategies as st

    return st.one_of([_struct(t, 0) for t in types])


def _struct(cls: type, depth: int) -> Any:
    from hypothesis import strategies as st

    hints = typing.get_type_hints(cls)
    fields = {name: _of(hints[name], depth + 1) for name in cls.__struct_fields__}  # type: ignore[attr-defined]
    return st.builds(cls, **fields)


def _of(tp: Any, depth: int) -> Any:
    from hypothesis import strategies as st

    from protocol.messages import Spec, encode_spec

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.one_of(st.integers(-3, 40), st.sampled_from(INTS),
                         st.integers(-(1 << 63), (1 << 64) - 1))
    if tp is str:
        return st.text(max_size=6)
    if tp is bytes:
        return st.one_of(st.binary(max_size=24),
                         st.lists(st.integers(0, 300), max_size=8).map(pack_uints))
    if tp is float:
        return st.floats(allow_nan=True)
    if tp is msgspec.Raw:
        return _struct(Spec, depth).map(encode_spec) if depth < 4 else st.just(
            encode_spec(Spec(req_id="r")))
    if tp is Any or tp is object:
        return st.none()
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return st.one_of([_of(a, depth) for a in args])
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(_of(args[0], depth + 1), max_size=3 if depth < 4 else 0).map(tuple)
        return st.tuples(*[_of(a, depth + 1) for a in args])
    if tp is type(None):
        return st.none()
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _struct(tp, depth) if depth < 5 else st.nothing()
    raise TypeError(f"no strategy for {tp!r}")


Mutator = Callable[[random.Random, Frames, bytes], tuple[Frames, str]]
