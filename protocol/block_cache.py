"""The rebuild cache's flat block tables, patched with appends instead of rebuilt.

Theory of operation
-------------------
:func:`protocol.rebuild.cached_block_table` hands out each KV group's block tables of
the current schedule as one flat array (read-only, cached in the state's rebuild
cache under ``blocks{g}``).  Most steps only append a few blocks, so a commit does not
drop that cache: :func:`patch_later` notes the appended (handles, counts, values)
under ``patches{g}``, and :func:`flush_block_patches` inserts them into a new flat
array when the table is next read (most steps never read it).  Past
:data:`MAX_PATCHES` notes, or when rows were replaced or the schedule changed, the
cache is dropped and the next read gathers it from the block columns.

Contract: the cached arrays are replaced, never edited (a consumer may hold them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from protocol.request import IntArray

if TYPE_CHECKING:
    from protocol.state import ReplicaState

#: appends kept for a cached flat block table before it is dropped instead (a table
#: rebuilt from the block columns costs about as much as this many patches)
MAX_PATCHES = 16


def patch_later(state: ReplicaState, g: int, rows: tuple[Any, Any, Any] | None,
                same_schedule: bool) -> None:
    """Group ``g``'s appended (handles, counts, values) for its cached flat table, or
    drop that cache (rows None: replaced rows; or too many patches pending)."""
    cache = state._rebuild_cache
    cached: Any = cache.get(f"blocks{g}")
    patches: Any = cache.get(f"patches{g}")
    if rows is not None and same_schedule and cached is not None and \
            (patches is None or len(patches) < MAX_PATCHES):
        # patched when next read (flush_block_patches): most steps never read it
        cache.setdefault(f"patches{g}", []).append(rows)  # type: ignore[attr-defined]
    else:
        cache.pop(f"blocks{g}", None)
        cache.pop(f"patches{g}", None)


def flush_block_patches(state: ReplicaState, g: int) -> None:
    """Apply the appends committed since group ``g``'s flat table cache was last read."""
    pending: Any = state._rebuild_cache.pop(f"patches{g}", None)
    for patch in pending or ():
        _patch_block_cache(state, g, *patch)


def _patch_block_cache(state: ReplicaState, g: int, handles: Any, row_counts: Any,
                       row_values: Any) -> None:
    """Insert appended blocks into the cached flat table instead of rebuilding it (O(n)
    memcpy, no per-row Python).  Arrays or lists."""
    hs, counts = np.asarray(handles, dtype=np.int64), np.asarray(row_counts, dtype=np.int64)
    values = np.asarray(row_values, dtype=np.int64)
    key, cache = f"blocks{g}", state._rebuild_cache
    cached: Any = cache.get(key)
    if cached is None or cached[0] is not state.schedule:
        cache.pop(key, None)
        return
    pos = schedule_positions(state)[hs]
    if (pos < 0).any():  # a row outside the schedule: nothing cached to patch
        cache.pop(key, None)
        return
    _, lengths, flat = cached
    at, rows = np.repeat(np.cumsum(lengths)[pos], counts), np.repeat(pos, counts)
    # rows ending at the same offset (empty rows between them) insert in batch order
    order = np.lexsort((np.arange(at.size), rows, at))
    flat = np.insert(flat, at[order], values[order])
    lengths = lengths.copy()
    lengths[pos] += counts
    lengths.flags.writeable = flat.flags.writeable = False
    cache[key] = (state.schedule, lengths, flat)


def schedule_positions(state: ReplicaState) -> IntArray:
    """handle -> batch position for the current schedule (-1 when unscheduled); cached."""
    cached: Any = state._rebuild_cache.get("positions")
    if cached is None or cached[0] is not state.schedule:
        position = np.full(state.cols.capacity, -1, dtype=np.int64)
        position[state.schedule] = np.arange(state.schedule.size)
        cached = (state.schedule, position)
        state._rebuild_cache["positions"] = cached
    return cached[1]  # type: ignore[no-any-return]
