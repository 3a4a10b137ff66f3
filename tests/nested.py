"""The one structural-equality assertion for nested tensor structures in the tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from protocol.tensors import tensors_equal


def assert_same(a: Any, b: Any) -> None:
    """Equal structure (dict key order included); tensors compare bitwise with dtype and
    shape, and a numpy array stays numpy, a torch tensor stays torch."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, np.ndarray | torch.Tensor):
        assert type(b) is (np.ndarray if isinstance(a, np.ndarray) else torch.Tensor)
        assert tensors_equal(a, b), (a, b)
    else:
        assert a == b
