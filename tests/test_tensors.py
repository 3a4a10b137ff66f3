"""Zero-copy tensor/ndarray frames inside msgspec messages (protocol.tensors)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nested import assert_same, tensors

from protocol.errors import MalformedMessage
from protocol.tensors import (
    EXT_NDARRAY,
    EXT_TENSOR,
    count_tensor_bytes,
    make_enc_hook,
    make_ext_hook,
    tensors_equal,
)

Msg = dict[str, Any]


def encode(msg: Any) -> tuple[bytes, list[Any]]:
    aux: list[Any] = []
    body = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode(msg)
    return body, aux


def decode(body: bytes, frames: list[Any], copy: bool = False) -> Any:
    return msgspec.msgpack.Decoder(Msg, ext_hook=make_ext_hook(frames, copy=copy)).decode(body)


def roundtrip(msg: Msg, copy: bool = False) -> Any:
    body, aux = encode(msg)
    return decode(body, aux, copy=copy)


def _nan_payload() -> np.ndarray:
    return np.array([0x7FC00001, 0xFFC12345, 0x7F800000, 0xFF800000], np.uint32).view(np.float32)


ZOO: dict[str, Callable[[], Any]] = {
    "bf16": lambda: torch.tensor([1.5, -2.0, float("inf"), float("nan")], dtype=torch.bfloat16),
    "bf16_2d_t": lambda: torch.randn(3, 5).to(torch.bfloat16).t(),
    "f16": lambda: torch.tensor([0.1, float("-inf")], dtype=torch.float16),
    "f32_nan_bits": lambda: torch.from_numpy(_nan_payload().copy()),
    "f64": lambda: torch.randn(2, 3, dtype=torch.float64),
    "i8": lambda: torch.tensor([-128, 127], dtype=torch.int8),
    "i16": lambda: torch.arange(-5, 5, dtype=torch.int16),
    "i32": lambda: torch.arange(12, dtype=torch.int32).reshape(3, 4),
    "i64": lambda: torch.tensor([2**63 - 1, -(2**63)]),
    "u8": lambda: torch.arange(256, dtype=torch.uint8),
    "bool": lambda: torch.tensor([[True, False], [False, True]]),
    "c64": lambda: torch.tensor([1 + 2j, float("nan")], dtype=torch.complex64),
    "c128": lambda: torch.randn(4, dtype=torch.complex128),
    "conj_view": lambda: torch.randn(3, dtype=torch.complex64).conj(),
    "scalar_0d": lambda: torch.tensor(3.25),
    "empty_0x3": lambda: torch.empty(0, 3),
    "transposed": lambda: torch.arange(20.0).reshape(4, 5).t(),
    "sliced": lambda: torch.arange(40, dtype=torch.int64)[::2],
    "expanded": lambda: torch.arange(3.0).expand(4, 3),
    "requires_grad": lambda: torch.ones(3, requires_grad=True),
    "large_2mb": lambda: torch.randn(512, 1024),
    "np_f32_nan_bits": _nan_payload,
    "np_f16": lambda: np.array([np.inf, -np.inf, np.nan, 1.0], np.float16),
    "np_f64": lambda: np.linspace(0, 1, 7),
    "np_ints": lambda: np.arange(-6, 6, dtype=np.int8).reshape(2, 2, 3),
    "np_uints": lambda: np.array([0, 2**64 - 1], np.uint64),
    "np_u16": lambda: np.array([1, 65535], np.uint16),
    "np_u32": lambda: np.array([[7]], np.uint32),
    "np_bool": lambda: np.array([True, False, True]),
    "np_c128": lambda: np.array([1j, -1 - 1j]),
    "np_scalar_0d": lambda: np.array(7, np.int32),
    "np_empty": lambda: np.empty((0, 3), np.float32),
    "np_fortran": lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "np_sliced": lambda: np.arange(30, dtype=np.int16).reshape(5, 6)[::2, 1::3],
    "np_large": lambda: np.random.default_rng(0).random(300_000),
}


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_roundtrip_nested(name: str) -> None:
    t = ZOO[name]()
    msg = {"a": [t, {"b": [t, 1, "x"]}], "c": {"d": [[t]]}, "n": None}
    for copy in (False, True):
        out = roundtrip(msg, copy=copy)
        assert_same(msg, out)
        assert out["a"][0].shape == t.shape and out["a"][0].dtype == t.dtype


def test_whole_zoo_in_one_message_frame_accounting() -> None:
    msg = {name: make() for name, make in ZOO.items()}
    body, aux = encode(msg)
    assert len(aux) == len(msg)
    assert count_tensor_bytes(aux) == sum(
        t.nbytes if isinstance(t, np.ndarray) else t.numel() * t.element_size()
        for t in msg.values()
    )
    # frames as they come out of zmq: bytes and zmq.Frame objects
    assert_same(msg, decode(body, [bytes(f) for f in aux]))
    assert_same(msg, decode(body, [zmq.Frame(bytes(f)) for f in aux]))


def test_struct_field_typed_any() -> None:
    class Step(msgspec.Struct):
        step: int
        payload: Any

    aux: list[Any] = []
    body = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode(
        Step(3, {"x": torch.ones(2, 2)})
    )
    out = msgspec.msgpack.Decoder(Step, ext_hook=make_ext_hook(aux)).decode(body)
    assert out.step == 3 and tensors_equal(out.payload["x"], torch.ones(2, 2))


def test_non_native_byte_order_becomes_native() -> None:
    arr = np.arange(5, dtype=">f4")
    out = roundtrip({"x": arr})["x"]
    assert out.dtype == np.dtype("<f4") and np.array_equal(out, arr)


@pytest.mark.parametrize(
    "obj",
    [object(), np.float32(1.0), np.array(["a"]), np.array([None]), torch.zeros(2).to_sparse()],
)
def test_unsupported_objects_raise_type_error(obj: Any) -> None:
    with pytest.raises(TypeError):
        encode({"x": obj})


def test_contiguous_encode_aliases_source_memory() -> None:
    # WHY the lifetime rule exists: the frame *is* the tensor's memory.
    t = torch.zeros(4, dtype=torch.float32)
    a = np.zeros(4, dtype=np.int32)
    _, aux = encode({"t": t, "a": a})
    t[0] = 1.0
    a[1] = 7
    assert bytes(aux[0][:4]) == np.float32(1.0).tobytes()
    assert bytes(aux[1][4:8]) == np.int32(7).tobytes()


def test_decode_copy_true_is_independent_of_frames() -> None:
    src = {"t": torch.arange(6.0), "a": np.arange(6, dtype=np.int64)}
    body, aux = encode(src)
    frames = [bytearray(f) for f in aux]
    copied = decode(body, frames, copy=True)
    aliased = decode(body, frames, copy=False)
    for f in frames:
        f[:] = b"\xff" * len(f)
    assert_same(src, copied)
    assert not tensors_equal(aliased["t"], src["t"])  # copy=False aliases the frame
    assert not tensors_equal(aliased["a"], src["a"])


def test_read_only_frames_give_read_only_numpy() -> None:
    body, aux = encode({"a": np.arange(3)})
    out = decode(body, [bytes(f) for f in aux])["a"]
    assert not out.flags.writeable


def test_misaligned_frame_is_realigned() -> None:
    body, aux = encode({"t": torch.arange(5, dtype=torch.float64)})
    raw = bytearray(1 + len(aux[0]))
    raw[1:] = aux[0]
    out = decode(body, [memoryview(raw)[1:]])["t"]
    assert out.data_ptr() % 8 == 0 and tensors_equal(out, torch.arange(5, dtype=torch.float64))


def test_import_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, msgspec\n"
        "from protocol.tensors import make_enc_hook, make_ext_hook, tensors_equal\n"
        "aux = []\n"
        "body = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode([np.ones(3)])\n"
        "out = msgspec.msgpack.Decoder(ext_hook=make_ext_hook(aux)).decode(body)\n"
        "assert tensors_equal(out[0], np.ones(3))\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(_repo_root()))


def test_torch_decode_of_read_only_frame_does_not_warn() -> None:
    code = (
        "import torch, msgspec\n"
        "from protocol.tensors import make_enc_hook, make_ext_hook\n"
        "aux = []\n"
        "body = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)).encode([torch.ones(3)])\n"
        "msgspec.msgpack.Decoder(ext_hook=make_ext_hook([bytes(f) for f in aux])).decode(body)\n"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, cwd=_repo_root())


def _repo_root() -> Any:
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def test_tensors_equal_semantics() -> None:
    x = torch.arange(4.0)
    assert tensors_equal(x, x.clone())
    assert not tensors_equal(x, x.numpy())  # library matters
    assert not tensors_equal(x, x.double())  # dtype matters
    assert not tensors_equal(x, x.reshape(2, 2))  # shape matters
    nan = torch.tensor([float("nan")])
    assert tensors_equal(nan, nan.clone())  # bitwise, so NaN == NaN
    assert not tensors_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert tensors_equal(torch.empty(0, 3), torch.empty(0, 3))
    assert tensors_equal(x.reshape(2, 2).t(), x.reshape(2, 2).t().contiguous())


# ---------------------------------------------------------------- property tests

_NP_DTYPES = (
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
)  # fmt: skip


nested = st.recursive(
    tensors(_NP_DTYPES) | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=3),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3)
    ),
    max_leaves=6,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=3), nested, max_size=3), st.booleans())
def test_random_nested_roundtrip(msg: Msg, copy: bool) -> None:
    assert_same(msg, roundtrip(msg, copy=copy))


# ---------------------------------------------------------------- malformed input


def _ext(code: int, header: bytes) -> bytes:
    return msgspec.msgpack.encode({"x": msgspec.msgpack.Ext(code, header)})


@pytest.mark.parametrize(
    ("code", "header", "frames"),
    [
        (EXT_TENSOR, b"", []),  # truncated
        (EXT_TENSOR, b"\x07", []),  # truncated
        (EXT_TENSOR, b"\x63\x01\x01\x00", [b"\0"]),  # unknown dtype code
        (EXT_TENSOR, b"\x07\x41" + b"\x01" * 66, [b"\0" * 4]),  # ndim > 64
        (EXT_TENSOR, b"\x07\x01\x01", [b"\0" * 4]),  # missing frame index
        (EXT_TENSOR, b"\x07\x01\x01\x01", [b"\0" * 4]),  # frame index out of range
        (EXT_TENSOR, b"\x07\x01\x02\x00", [b"\0" * 4]),  # frame too short
        (EXT_NDARRAY, b"\x07\x01\x01\x00", [b"\0" * 5]),  # frame too long
        (EXT_TENSOR, b"\x07\x01\x01\x00\x00", [b"\0" * 4]),  # trailing bytes
        (EXT_TENSOR, b"\x07\x01\x81\x00\x00", [b"\0" * 4]),  # non-canonical varint
        (EXT_TENSOR, b"\x07\x01" + b"\xff" * 10 + b"\x01\x00", [b""]),  # overlong varint
        (EXT_TENSOR, b"\x07\x02\x00" + b"\xff" * 8 + b"\x7f\x00", [b""]),  # huge dim x 0
        (EXT_NDARRAY, b"\x09\x00\x00", [b"\0\0"]),  # bfloat16 as numpy
        (99, b"\x07\x00\x00", [b"\0" * 4]),  # unknown ext type
    ],
)
def test_malformed_raises(code: int, header: bytes, frames: list[bytes]) -> None:
    with pytest.raises(MalformedMessage):
        decode(_ext(code, header), frames)


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from([EXT_TENSOR, EXT_NDARRAY, 0, 3, 127]),
    st.binary(max_size=24)
    | st.builds(lambda a, b: bytes([a, b]), st.integers(0, 15), st.integers(0, 4)).flatmap(
        lambda head: st.binary(max_size=12).map(lambda tail: head + tail)
    ),
    st.lists(st.binary(max_size=16), max_size=3),
)
def test_fuzz_header_only_malformed(code: int, header: bytes, frames: list[bytes]) -> None:
    try:
        out = decode(_ext(code, header), frames)
    except MalformedMessage:
        return
    x = out["x"]
    assert isinstance(x, torch.Tensor if code == EXT_TENSOR else np.ndarray)
