"""The one structural-equality assertion for nested structures in the tests, and the
tensor zoo the property tests draw from."""

from __future__ import annotations

from typing import Any

import hypothesis.extra.numpy as hnp
import msgspec
import numpy as np
import torch
from hypothesis import strategies as st

from protocol.tensors import tensors_equal

#: the zoo's default dtypes (a test passes its own list to draw from more)
ZOO_DTYPES = ("float32", "float16", "int64", "uint8", "bool")


def assert_same(a: Any, b: Any, path: str = "obj") -> None:
    """Deep equality: the same types (a tuple stays a tuple, a msgspec Struct its own
    class, field by field), dict key order included; tensors compare bitwise with dtype
    and shape, and a numpy array stays numpy, a torch tensor stays torch.  ``path``
    names the place that differs."""
    if isinstance(a, msgspec.Struct):
        assert type(a) is type(b), path
        for name in a.__struct_fields__:
            assert_same(getattr(a, name), getattr(b, name), f"{path}.{name}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, np.ndarray | torch.Tensor):
        assert type(b) is type(a) and tensors_equal(a, b), path
    else:
        assert type(a) is type(b) and a == b, path


@st.composite
def tensors(draw: st.DrawFn, dtypes: tuple[str, ...] = ZOO_DTYPES,
            max_side: int = 4) -> Any:
    """The zoo: numpy and torch, bf16, 0-d, empty and non-contiguous tensors of
    ``dtypes`` (sides up to ``max_side``)."""
    dtype = np.dtype(draw(st.sampled_from(dtypes)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=max_side))
    arr = draw(hnp.arrays(dtype, shape))
    if arr.ndim >= 2 and draw(st.booleans()):
        arr = arr.T  # non-contiguous
    kind = draw(st.sampled_from(["numpy", "torch", "bf16"]))
    if kind == "numpy":
        return arr
    t = torch.from_numpy(np.array(arr))  # np.array: own a writable copy
    if kind == "bf16" and dtype.kind == "f":
        t = t.to(torch.bfloat16)
    return t[::2] if t.ndim and draw(st.booleans()) else t
