"""Shared test input: the first step of a small replica, through ``EngineMirror.step``
(tests/test_small_paths.py imports it)."""

from __future__ import annotations

from engine_side.mirror import EngineMirror, Entry
from protocol.messages import Delta, DeltaBody, Spec
from protocol.packing import pack_uints


def first_step(n: int, groups: int, mirror: EngineMirror | None = None,
               ) -> tuple[EngineMirror, Delta]:
    """``n`` requests ``r0..`` of an 8-token prompt, 8 tokens computed, 1 or 2 scheduled
    tokens each, and ``i % 3`` blocks ``[100 * k + i, ...]`` in every KV group (so some
    rows start empty): the mirror after that step and its Delta."""
    mirror = mirror or EngineMirror(kv_groups=groups)
    specs = [Spec(req_id=f"r{i}", prompt=pack_uints(list(range(8)))) for i in range(n)]
    rows = [i for i in range(n) if i % 3]
    tables = [(rows, [i % 3 for i in rows], [100 * k + i for i in rows for k in range(i % 3)])
              for _ in range(groups)]
    delta, _ = mirror.step([f"r{i}" for i in range(n)], [1 + i % 2 for i in range(n)],
                           added=[Entry(s, 8) for s in specs], appends=tables)
    return mirror, delta


def first_body(n: int, groups: int) -> DeltaBody:
    """The body of :func:`first_step`."""
    return first_step(n, groups)[1].body
