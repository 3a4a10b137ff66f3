"""Zero-copy torch tensors and numpy arrays inside msgspec messages.

A tensor anywhere in a message (a dict value, a list item, a Struct field typed
``Any``) is encoded as a msgpack Ext whose payload is a small header; its raw
bytes travel as an extra zmq frame.  Frame 0 is the msgpack body, tensor frame
``i`` is ``frames[1 + i]``.  Ext payload (all integers unsigned LEB128)::

    byte 0      dtype code (see ``_DTYPES``; codes never change)
    byte 1      ndim (0..64)
    ndim ints   each dimension
    1 int       index of the data frame among the extra frames

Ext code ``EXT_TENSOR`` decodes to a ``torch.Tensor``, ``EXT_NDARRAY`` to a
``numpy.ndarray``.  Data is C-order, little-endian (the only supported host
byte order); bfloat16 travels as its raw 16-bit patterns.

Buffer-lifetime rule:

* Encoding does not copy contiguous tensors: the extra frames are memoryviews
  aliasing the sender's tensor memory until the transport has finished sending
  them.  The transport MUST either copy frames into the socket (small ones) or
  wait on zmq's ``MessageTracker`` before returning from send.  Callers may
  mutate a sent tensor only after send returns.  (Non-contiguous, non-CPU,
  byte-swapped or conjugate-view tensors are copied once while encoding.)
* Decoded tensors alias the received frames unless ``copy=True``.  Such views
  are read-only if the frame is (numpy marks them read-only; torch cannot, so
  treat them as read-only: writing into one is undefined behaviour).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np

from protocol.errors import MalformedMessage
from protocol.packing import leb128, read_leb128

EXT_TENSOR = 1
EXT_NDARRAY = 2

_MAX_NDIM = 64
_MAX_NBYTES = 2**63 - 1  # bound on prod(nonzero dims) * itemsize (numpy's limit)

# code -> dtype name; the name is the attribute on both numpy and torch.
_DTYPES: dict[int, str] = {
    0: "bool",
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "bfloat16",  # torch only
    10: "complex64",
    11: "complex128",
    12: "uint16",
    13: "uint32",
    14: "uint64",
}
_CODE_BY_NAME = {name: code for code, name in _DTYPES.items()}
_NP_CODES: dict[np.dtype[Any], int] = {
    np.dtype(name): code for code, name in _DTYPES.items() if name != "bfloat16"
}
_BF16 = _CODE_BY_NAME["bfloat16"]

if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("protocol.tensors supports little-endian hosts only")


def _torch() -> Any:
    """The torch module, imported only when a torch tensor is actually involved."""
    import torch

    return torch


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")  # no torch loaded => obj cannot be a tensor
    return torch is not None and isinstance(obj, torch.Tensor)


# ---------------------------------------------------------------- encoding


def _np_bytes(arr: np.ndarray[Any, Any]) -> tuple[int, memoryview]:
    """(dtype code, flat byte view of C-contiguous native data); copies only if needed."""
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    code = _NP_CODES.get(arr.dtype)
    if code is None or type(arr) is np.ma.MaskedArray:
        raise TypeError(f"unsupported numpy array dtype {arr.dtype} / type {type(arr)}")
    arr = np.ascontiguousarray(arr)
    return code, arr.reshape(-1).view(np.uint8).data


def _torch_bytes(t: Any) -> tuple[int, memoryview]:
    """(dtype code, flat byte view of the tensor's C-contiguous CPU data)."""
    torch = _torch()
    name = str(t.dtype).removeprefix("torch.")
    code = _CODE_BY_NAME.get(name)
    if code is None or t.layout != torch.strided or t.is_quantized or t.is_meta:
        raise TypeError(f"unsupported tensor dtype {t.dtype} / layout {t.layout}")
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if code == _BF16:
        t = t.view(torch.int16)
    return code, t.numpy().reshape(-1).view(np.uint8).data


def _header(code: int, shape: Sequence[int], index: int) -> bytes:
    if len(shape) > _MAX_NDIM:
        raise TypeError(f"tensors with more than {_MAX_NDIM} dimensions are unsupported")
    parts = [bytes((code, len(shape)))]
    parts.extend(leb128(int(d)) for d in shape)
    parts.append(leb128(index))
    return b"".join(parts)


def make_enc_hook(aux: list[Any]) -> Callable[[Any], Any]:
    """An msgspec ``enc_hook`` that moves tensor/array data into ``aux`` frames.

    Each tensor appends one zero-copy ``memoryview`` to ``aux`` and encodes as
    ``Ext(EXT_TENSOR | EXT_NDARRAY, header)``.  Any other object: ``TypeError``.
    """

    def enc_hook(obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            ext_code = EXT_NDARRAY
            code, data = _np_bytes(obj)
        elif _is_torch_tensor(obj):
            ext_code = EXT_TENSOR
            code, data = _torch_bytes(obj)
        else:
            raise TypeError(f"cannot encode objects of type {type(obj).__name__}")
        header = _header(code, obj.shape, len(aux))
        aux.append(data)
        return msgspec.msgpack.Ext(ext_code, header)

    return enc_hook


def count_tensor_bytes(aux: Sequence[Any]) -> int:
    """Total payload bytes of the extra frames produced by an enc_hook."""
    return sum(memoryview(f).nbytes for f in aux)


# ---------------------------------------------------------------- decoding


def _parse_header(data: memoryview) -> tuple[int, tuple[int, ...], int]:
    """Validate and split an Ext payload into (dtype code, shape, frame index)."""
    if len(data) < 2:
        raise MalformedMessage("truncated tensor header", length=len(data))
    code, ndim = data[0], data[1]
    if code not in _DTYPES:
        raise MalformedMessage("unknown tensor dtype code", code=code)
    if ndim > _MAX_NDIM:
        raise MalformedMessage("too many tensor dimensions", ndim=ndim)
    pos, shape = 2, []
    for _ in range(ndim):
        dim, pos = read_leb128(data, pos, "tensor header")
        shape.append(dim)
    index, pos = read_leb128(data, pos, "tensor header")
    if pos != len(data):
        raise MalformedMessage("trailing bytes in tensor header", extra=len(data) - pos)
    return code, tuple(shape), index


def _frame_view(frame: Any) -> memoryview:
    """A flat byte memoryview of a bytes / memoryview / zmq.Frame-like frame."""
    buf = getattr(frame, "buffer", frame)  # zmq.Frame exposes .buffer
    view = memoryview(buf)
    if not view.c_contiguous:
        raise MalformedMessage("tensor frame is not contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _check_size(code: int, shape: tuple[int, ...], nbytes: int) -> int:
    """Return the itemsize after checking prod(shape) * itemsize == nbytes."""
    itemsize = 2 if code == _BF16 else np.dtype(_DTYPES[code]).itemsize
    total = bound = itemsize
    for dim in shape:
        total *= dim
        bound *= max(dim, 1)
        if bound > _MAX_NBYTES:
            raise MalformedMessage("tensor shape too large", shape=shape)
    if total != nbytes:
        raise MalformedMessage("tensor frame size mismatch", expected=total, got=nbytes)
    return itemsize


def _to_numpy(code: int, shape: tuple[int, ...], view: memoryview, copy: bool) -> Any:
    """Array over ``view`` (bf16 as int16); copied if asked or misaligned."""
    dtype = np.dtype(np.int16 if code == _BF16 else _DTYPES[code])
    arr = np.frombuffer(view, dtype=dtype)
    if copy or not arr.flags.aligned:
        arr = arr.copy()
    return arr.reshape(shape)


def _to_torch(arr: Any, code: int) -> Any:
    torch = _torch()
    with warnings.catch_warnings():  # read-only frames: documented in module docstring
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        t = torch.from_numpy(arr)
    return t.view(torch.bfloat16) if code == _BF16 else t


def make_ext_hook(frames: Sequence[Any], copy: bool = False) -> Callable[[int, memoryview], Any]:
    """An msgspec ``ext_hook`` rebuilding tensors from ``frames`` (the extra frames).

    ``copy=False``: results alias the frames (treat as read-only; keep the
    frames alive).  ``copy=True``: results own fresh memory.  Any invalid
    payload raises :class:`MalformedMessage`.
    """

    def ext_hook(ext_code: int, data: memoryview) -> Any:
        if ext_code not in (EXT_TENSOR, EXT_NDARRAY):
            raise MalformedMessage("unknown msgpack ext type", code=ext_code)
        code, shape, index = _parse_header(data)
        if index >= len(frames):
            raise MalformedMessage("tensor frame index out of range", index=index)
        view = _frame_view(frames[index])
        _check_size(code, shape, view.nbytes)
        if ext_code == EXT_NDARRAY:
            if code == _BF16:
                raise MalformedMessage("bfloat16 is not a numpy dtype")
            return _to_numpy(code, shape, view, copy)
        return _to_torch(_to_numpy(code, shape, view, copy), code)

    return ext_hook


# ---------------------------------------------------------------- comparison


def tensors_equal(a: Any, b: Any) -> bool:
    """Bitwise equality of two tensors/arrays: same library, dtype, shape and bytes."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return a.tobytes() == b.tobytes()  # dtypes are equal, so byte orders agree
    if _is_torch_tensor(a) and _is_torch_tensor(b):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(_torch_bytes(a)[1] == _torch_bytes(b)[1])
    return False


def tensor_bytes(obj: Any) -> bytes:
    """Dtype code, shape and raw bytes of a tensor/array, for content hashing."""
    code, view = _torch_bytes(obj) if _is_torch_tensor(obj) else _np_bytes(np.asarray(obj))
    return bytes([code]) + repr(tuple(obj.shape)).encode() + bytes(view)
