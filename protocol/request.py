"""The full per-step request a worker executes, in a columnar layout.

``ExecuteModelRequest`` is self-contained: everything a worker needs to run one
step is in it, for every scheduled request (in batch order).  It is what the
engine *means* each step; deltas are only a cheap way to rebuild it remotely.

Layout: per-request columns are numpy arrays aligned with ``req_ids`` (batch
order); variable-length per-request lists (block ids, speculative tokens,
encoder inputs) are :class:`Ragged` arrays (``lengths`` + flat ``values``).
Static request data (:class:`RequestSpec`) is immutable and may be shared; every
mutable container in a rebuilt request is fresh.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from protocol.params import LoRASpec, MMFeatureRef, PoolingSpec, SamplingSpec

IntArray = npt.NDArray[np.integer[Any]]  # int64 columns; block-table values may be int32


class Ragged(msgspec.Struct, frozen=True):
    """A list of integer lists as ``lengths`` (one per row) and flat ``values``."""

    lengths: IntArray
    values: IntArray

    @staticmethod
    def from_lists(rows: list[list[int]] | list[IntArray]) -> Ragged:
        lengths = np.array([len(r) for r in rows], dtype=np.int64)
        flat = [np.asarray(r, dtype=np.int64) for r in rows]
        values = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
        return Ragged(lengths, values.astype(np.int64, copy=False))

    @staticmethod
    def empty(rows: int) -> Ragged:
        return Ragged(np.zeros(rows, dtype=np.int64), np.zeros(0, dtype=np.int64))

    def offsets(self) -> IntArray:
        out = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=out[1:])
        return out

    def row(self, i: int) -> IntArray:
        off = self.offsets()
        return self.values[off[i] : off[i + 1]]

    def to_lists(self) -> list[list[int]]:
        off = self.offsets()
        vals = self.values.tolist()
        return [vals[off[i] : off[i + 1]] for i in range(len(self.lengths))]


class RequestSpec(msgspec.Struct, frozen=True):
    """What is fixed for a request's lifetime; crosses the wire once.

    ``prompt_token_ids`` is a read-only int64 array (or None with embeddings only).
    """

    req_id: str
    prompt_token_ids: IntArray | None
    sampling: SamplingSpec | None = None
    pooling: PoolingSpec | None = None
    lora: LoRASpec | None = None
    mm_features: tuple[MMFeatureRef, ...] = ()
    prompt_embeds: Any = None
    prompt_is_token_ids: tuple[bool, ...] | None = None


class ExecuteModelRequest(msgspec.Struct):
    """One step, complete.  Columns align with ``req_ids`` (batch order).

    ``block_tables`` holds one Ragged per KV-cache group with each request's
    *whole* block table (rebuilt values are int32: block ids are below 2**31;
    equality ignores integer width).  ``output_token_ids`` is None when workers own their
    sampled tokens (tensor parallelism); otherwise each row is the request's
    whole output history (engine-sent tokens).
    """

    req_ids: list[str]
    specs: list[RequestSpec]
    num_scheduled_tokens: IntArray
    num_computed_tokens: IntArray
    block_tables: tuple[Ragged, ...]
    spec_token_ids: Ragged
    encoder_inputs: Ragged
    output_token_ids: list[IntArray] | None = None
    finished_req_ids: frozenset[str] = frozenset()
    preempted_req_ids: frozenset[str] = frozenset()
    resumed_req_ids: frozenset[str] = frozenset()
    free_encoder_mm_hashes: tuple[str, ...] = ()
    blocks_to_zero: IntArray | None = None
    has_structured_output_requests: bool = False
    pending_structured_output_tokens: bool = False
    num_spec_tokens_to_schedule: int = 0
    extension: dict[str, bytes] = msgspec.field(default_factory=dict)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return int(self.num_scheduled_tokens.sum())


def _same_array(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(np.array_equal(np.asarray(a), np.asarray(b)))


def _same_value(a: Any, b: Any) -> bool:
    """Deep equality that understands numpy arrays and torch tensors."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _same_array(a, b)
    if type(a).__module__.startswith("torch") or type(b).__module__.startswith("torch"):
        from protocol.tensors import tensors_equal

        return tensors_equal(a, b)
    if isinstance(a, Ragged) and isinstance(b, Ragged):
        return _same_array(a.lengths, b.lengths) and _same_array(a.values, b.values)
    if isinstance(a, msgspec.Struct) and isinstance(b, msgspec.Struct):
        return type(a) is type(b) and all(
            _same_value(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same_value, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_value(a[k], b[k]) for k in a)
    return bool(type(a) is type(b) and a == b)


def request_differences(a: ExecuteModelRequest, b: ExecuteModelRequest) -> list[str]:
    """Names of the fields on which two requests differ (empty when equal)."""
    return [f for f in a.__struct_fields__ if not _same_value(getattr(a, f), getattr(b, f))]


def requests_equal(a: ExecuteModelRequest, b: ExecuteModelRequest) -> bool:
    """Exact equality: same values, dtypes aside (all integer columns are int64)."""
    return not request_differences(a, b)
