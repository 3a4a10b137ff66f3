"""Shared test input: the first Delta body of a small replica (tests import it)."""

from __future__ import annotations

import numpy as np

from engine_side.mirror import EngineMirror
from protocol.messages import DeltaBody
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec


def first_body(n: int, groups: int) -> DeltaBody:
    """``n`` requests of an 8-token prompt, 1 or 2 scheduled tokens each, and ``i % 3``
    blocks in every KV group (so some rows start empty)."""
    ids = [f"r{i}" for i in range(n)]
    prompt = np.arange(8, dtype=np.int64)
    prompt.flags.writeable = False
    tables = tuple(Ragged.from_lists([[100 * g + i] * (i % 3) for i in range(n)])
                   for g in range(groups))
    request = ExecuteModelRequest(
        req_ids=ids, specs=[RequestSpec(rid, prompt) for rid in ids],
        num_scheduled_tokens=np.array([1 + i % 2 for i in range(n)], dtype=np.int64),
        num_computed_tokens=np.full(n, 8, dtype=np.int64), block_tables=tables,
        spec_token_ids=Ragged.empty(n), encoder_inputs=Ragged.empty(n))
    return EngineMirror(kv_groups=groups).diff(request).body
