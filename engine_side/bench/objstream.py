"""Object streams: vLLM's own per-step objects on disk, independent of deltacast's wire.

A stream is the sequence of objects one vLLM run passes its executor:
``execute_model`` (SchedulerOutput), ``sample_tokens`` (GrammarOutput or None),
``reply`` / ``sample_reply`` (ModelRunnerOutput or None).  Nothing is pickled:
each object becomes a tagged tree of msgpack values and comes back exactly --
the same types all the way down, every field (private ones included), dict key
types and order, sets, tuples, enum members, NaN payloads and -0.0, ints of any
size, numpy arrays and torch tensors bit for bit.

Tree encoding (``"@..."`` keys are tags; plain dicts never hold such a key)::

    None bool int float str bytes list   as themselves (ints past 64 bits: {"@i": "123..."})
    dict of str keys                     a map; other keys (or "@..." ones): {"@d": [k, v, ...]}
    tuple / set / frozenset              {"@t": [...]} / {"@s": [...]} / {"@fs": [...]}
    dataclass / msgspec.Struct / NamedTuple   {"@": "module:QualName", field: value, ...}
    enum member                          {"@e": ["module:QualName", value]}
    numpy array / numpy scalar           {"@nd": [dtype, shape, bytes]} / {"@ns": [dtype, bytes]}
    torch tensor                         {"@pt": [dtype, shape, bytes]}

Decoding builds instances with ``cls.__new__`` and sets every field (no
``__init__`` / ``__post_init__``; a msgspec Struct whose ``__new__`` refuses is
copied from a template built once per class), so values are exactly as recorded.
Classes resolve only under an allow-list of module prefixes (``vllm.`` plus the
caller's ``allow``) and must be dataclasses, Structs, NamedTuples or Enums: any
other name is a :class:`ValueError`, on writing as on reading.

File: ``MAGIC``, then length-prefixed (u32 little-endian) zlib-compressed msgpack
records: first the header ``{"format": 1, "meta": ...}``, then one
``[kind, tree]`` per object.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

__all__ = ["MAGIC", "KINDS", "StreamWriter", "write_stream", "read_stream", "iter_stream",
           "dumps", "loads"]

MAGIC = b"DCOBJ\x00\x01\n"
FORMAT = 1
KINDS = ("execute_model", "sample_tokens", "reply", "sample_reply")
DEFAULT_ALLOW = ("vllm.",)
Record = tuple[str, Any]

_LEN = struct.Struct("<I")
_MIN_INT, _MAX_INT = -(2 ** 63), 2 ** 64 - 1
_LEAVES = frozenset({type(None), bool, int, float, str, bytes})
_PLAIN = frozenset({type(None), bool, float, str, bytes})
_NO_TEMPLATE = object()


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _kind(cls: Any) -> str | None:
    """"struct", "dataclass", "namedtuple" or "enum" for a class we rebuild, else None."""
    if not isinstance(cls, type):
        return None
    if issubclass(cls, msgspec.Struct):
        return "struct"
    if issubclass(cls, enum.Enum):
        return "enum"
    if dataclasses.is_dataclass(cls):
        return "dataclass"
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return "namedtuple"
    return None


def _fields(cls: type, kind: str) -> tuple[str, ...]:
    if kind == "struct":
        return tuple(cls.__struct_fields__)  # type: ignore[attr-defined]
    if kind == "dataclass":
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    return tuple(cls._fields)  # type: ignore[attr-defined]


class _Codec:
    """The tree encoder / decoder, with its allow-list and per-class caches."""

    def __init__(self, allow: Iterable[str] = ()) -> None:
        self.allow = DEFAULT_ALLOW + tuple(allow)
        self._classes: dict[str, tuple[Any, str, tuple[str, ...]]] = {}
        self._templates: dict[type, Any] = {}

    # ------------------------------------------------------------ classes
    def _allowed(self, name: str) -> bool:
        return name.replace(":", ".").startswith(self.allow)

    def _check_class(self, cls: type) -> tuple[str, str, tuple[str, ...]]:
        name = _name(cls)
        if name in self._classes:
            return name, self._classes[name][1], self._classes[name][2]
        kind = _kind(cls)
        if kind is None or "<locals>" in name or not self._allowed(name):
            raise ValueError(f"objstream cannot encode {name}: only dataclasses, msgspec "
                             f"Structs, NamedTuples and Enums under {self.allow} are allowed")
        fields = () if kind == "enum" else _fields(cls, kind)
        self._classes[name] = (cls, kind, fields)
        return name, kind, fields

    def resolve(self, name: Any) -> tuple[Any, str, tuple[str, ...]]:
        """The class recorded as ``module:QualName`` (allow-listed), its kind and fields."""
        if type(name) is str and name in self._classes:
            return self._classes[name]
        if type(name) is not str or name.count(":") != 1 or not self._allowed(name):
            raise ValueError(f"objstream refuses class {name!r}: not under {self.allow}")
        module, qualname = name.split(":")
        try:
            obj: Any = importlib.import_module(module)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"objstream cannot find class {name!r}: {exc}") from exc
        kind = _kind(obj)
        if kind is None or _name(obj) != name:
            raise ValueError(f"objstream refuses {name!r}: not a dataclass, msgspec Struct, "
                             "NamedTuple or Enum defined under that name")
        fields = () if kind == "enum" else _fields(obj, kind)
        self._classes[name] = (obj, kind, fields)
        return obj, kind, fields

    # ------------------------------------------------------------ encoding
    def enc(self, obj: Any) -> Any:
        t = type(obj)
        if t in _PLAIN:
            return obj
        if t is int:
            return obj if _MIN_INT <= obj <= _MAX_INT else {"@i": str(obj)}
        if t is list:
            return [x if type(x) in _PLAIN or (type(x) is int and _MIN_INT <= x <= _MAX_INT)
                    else self.enc(x) for x in obj]
        if t is dict:
            if all(type(k) is str and not k.startswith("@") for k in obj):
                return {k: self.enc(v) for k, v in obj.items()}
            return {"@d": [self.enc(x) for kv in obj.items() for x in kv]}
        if t is tuple:
            return {"@t": [self.enc(x) for x in obj]}
        if t is set or t is frozenset:
            return {"@s" if t is set else "@fs": [self.enc(x) for x in obj]}
        if t is np.ndarray:
            if obj.dtype.hasobject:
                raise ValueError("objstream cannot encode a numpy array of Python objects")
            return {"@nd": [obj.dtype.str, list(obj.shape), np.ascontiguousarray(obj).tobytes()]}
        if isinstance(obj, np.generic) and not obj.dtype.hasobject:
            return {"@ns": [obj.dtype.str, obj.tobytes()]}
        if t.__module__ == "torch" and t.__name__ == "Tensor":
            return {"@pt": _tensor_parts(obj)}
        name, kind, fields = self._check_class(t)
        if kind == "enum":
            return {"@e": [name, self.enc(obj.value)]}
        out: dict[str, Any] = {"@": name}
        for field in fields:
            try:
                value = getattr(obj, field)
            except AttributeError:
                raise ValueError(f"objstream cannot encode {name}: field {field!r} is unset") \
                    from None
            out[field] = self.enc(value)
        return out

    # ------------------------------------------------------------ decoding
    def dec(self, v: Any) -> Any:
        t = type(v)
        if t is list:
            return [x if type(x) in _LEAVES else self.dec(x) for x in v]
        if t is not dict:
            return v
        if "@" in v:
            return self._object(v)
        if len(v) == 1:
            ((tag, body),) = v.items()
            if tag.startswith("@"):
                return self._tagged(tag, body)
        return {k: x if type(x) in _LEAVES else self.dec(x) for k, x in v.items()}

    def _tagged(self, tag: str, body: Any) -> Any:
        if tag == "@t":
            return tuple(self.dec(body))
        if tag == "@s":
            return set(self.dec(body))
        if tag == "@fs":
            return frozenset(self.dec(body))
        if tag == "@d":
            items = self.dec(body)
            return dict(zip(items[::2], items[1::2], strict=True))
        if tag == "@i":
            return int(body)
        if tag == "@nd":
            dtype, shape, raw = body
            return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
        if tag == "@ns":
            return np.frombuffer(body[1], dtype=np.dtype(body[0]))[0]
        if tag == "@pt":
            return _tensor(*body)
        if tag == "@e":
            cls, kind, _ = self.resolve(body[0])
            if kind != "enum":
                raise ValueError(f"objstream: {body[0]!r} is not an Enum")
            return cls(self.dec(body[1]))
        raise ValueError(f"objstream: unknown tag {tag!r}")

    def _object(self, v: dict[str, Any]) -> Any:
        cls, kind, fields = self.resolve(v["@"])
        if kind == "enum" or len(v) - 1 != len(fields) or any(f not in v for f in fields):
            got = sorted(k for k in v if k != "@")
            raise ValueError(f"objstream: {v['@']} holds fields {got}, this version has "
                             f"{sorted(fields)} (recorded with another vLLM?)")
        values = [self.dec(v[f]) for f in fields]
        if kind == "namedtuple":
            return tuple.__new__(cls, values)
        if kind == "dataclass":
            obj = cls.__new__(cls)
            for f, x in zip(fields, values, strict=True):
                object.__setattr__(obj, f, x)
            return obj
        obj = self._bare_struct(cls, fields, values)
        for f, x in zip(fields, values, strict=True):
            msgspec.structs.force_setattr(obj, f, x)
        return obj

    def _bare_struct(self, cls: Any, fields: tuple[str, ...], values: list[Any]) -> Any:
        """A Struct instance whose fields are all about to be overwritten."""
        template = self._templates.get(cls, _NO_TEMPLATE)
        if template is _NO_TEMPLATE:
            try:
                template = cls.__new__(cls)
                self._templates[cls] = None
                return template
            except TypeError:  # a plain Struct: build one instance once, copy it after
                try:
                    template = cls(**dict(zip(fields, values, strict=True)))
                except Exception as exc:
                    raise ValueError(f"objstream cannot build {_name(cls)}: {exc}") from exc
                self._templates[cls] = template
        if template is None:
            return cls.__new__(cls)
        obj = template.__copy__()
        if getattr(obj, "__dict__", None):
            obj.__dict__.clear()  # cached properties of the template
        return obj


def _tensor_parts(t: Any) -> list[Any]:
    import torch

    flat = t.detach().cpu().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return [str(t.dtype).removeprefix("torch."), list(t.shape), raw]


def _tensor(dtype: str, shape: list[int], raw: bytes) -> Any:
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"objstream: unknown torch dtype {dtype!r}")
    if not raw:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dt).reshape(shape)


# ---------------------------------------------------------------- bytes and files
@contextlib.contextmanager
def _malformed() -> Iterator[None]:
    """Decoding errors of a damaged or hostile file, as ValueError."""
    try:
        yield
    except ValueError:
        raise
    except (msgspec.DecodeError, TypeError, KeyError, IndexError, AttributeError, zlib.error,
            RecursionError) as exc:
        raise ValueError(f"malformed object stream: {exc!r}") from exc


def dumps(obj: Any, allow: Iterable[str] = ()) -> bytes:
    """One object as msgpack of its tree (no compression)."""
    return msgspec.msgpack.encode(_Codec(allow).enc(obj))


def loads(data: bytes, allow: Iterable[str] = ()) -> Any:
    """The object :func:`dumps` wrote."""
    with _malformed():
        return _Codec(allow).dec(msgspec.msgpack.decode(data))


class StreamWriter:
    """Collects records, each encoded when added (later edits of the object do not show),
    and writes the file with its header when asked."""

    def __init__(self, allow: Iterable[str] = (), level: int = 9) -> None:
        self._codec = _Codec(allow)
        self._level = level
        self.chunks: list[bytes] = []
        self.kinds: list[str] = []

    def add(self, kind: str, obj: Any) -> int:
        """Encode one record now; returns its compressed size."""
        if kind not in KINDS:
            raise ValueError(f"objstream: unknown record kind {kind!r}")
        chunk = zlib.compress(msgspec.msgpack.encode([kind, self._codec.enc(obj)]), self._level)
        self.chunks.append(chunk)
        self.kinds.append(kind)
        return len(chunk)

    def write(self, path: str | Path, meta: dict[str, Any]) -> int:
        """Write header and records to ``path``; returns the file size."""
        head = zlib.compress(msgspec.msgpack.encode({"format": FORMAT,
                                                     "meta": self._codec.enc(meta)}))
        parts = [MAGIC]
        for chunk in (head, *self.chunks):
            parts += [_LEN.pack(len(chunk)), chunk]
        data = b"".join(parts)
        Path(path).write_bytes(data)
        return len(data)


def write_stream(path: str | Path, records: Iterable[Record], meta: dict[str, Any],
                 allow: Iterable[str] = ()) -> int:
    """Write ``(kind, object)`` records with ``meta`` to ``path``; returns the file size."""
    writer = StreamWriter(allow)
    for kind, obj in records:
        writer.add(kind, obj)
    return writer.write(path, meta)


def _chunks(data: bytes) -> Iterator[bytes]:
    if not data.startswith(MAGIC):
        raise ValueError("not an object stream (bad magic)")
    pos = len(MAGIC)
    while pos < len(data):
        if pos + 4 > len(data):
            raise ValueError("object stream truncated")
        (n,) = _LEN.unpack_from(data, pos)
        if pos + 4 + n > len(data):
            raise ValueError("object stream truncated")
        with _malformed():
            chunk = zlib.decompress(data[pos + 4:pos + 4 + n])
        yield chunk
        pos += 4 + n


def iter_stream(path: str | Path, allow: Iterable[str] = ()
                ) -> tuple[dict[str, Any], Iterator[Record]]:
    """The header's meta and an iterator over the records, decoded one at a time."""
    codec = _Codec(allow)
    chunks = _chunks(Path(path).read_bytes())
    with _malformed():
        head = msgspec.msgpack.decode(next(chunks, b"\xc0"))
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        raise ValueError(f"object stream format {head!r} is not {FORMAT}")

    def records() -> Iterator[Record]:
        for chunk in chunks:
            with _malformed():
                kind, tree = msgspec.msgpack.decode(chunk)
                if kind not in KINDS:
                    raise ValueError(f"objstream: unknown record kind {kind!r}")
                obj = codec.dec(tree)
            yield kind, obj

    with _malformed():
        meta = codec.dec(head["meta"])
    return meta, records()


def read_stream(path: str | Path, allow: Iterable[str] = ()
                ) -> tuple[dict[str, Any], list[Record]]:
    """``(meta, [(kind, object), ...])`` of an object stream file."""
    meta, records = iter_stream(path, allow)
    return meta, list(records)
