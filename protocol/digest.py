"""The replicated-state digest: a 64-bit sum of per-item terms, updated in O(changes).

digest = Σ spec terms + Σ computed-token terms + Σ block terms + Σ token terms
         + schedule term   (all mod 2**64)

Each term is a splitmix64 mix of an item keyed by its handle and position, or (the
computed and scheduled counts) the count times such a mixed odd key, so a change
anywhere changes the digest with overwhelming probability, and adding or removing
one item changes only its own term.  The linear terms make a count change one
product (the steady lane's count exceptions and advances).  No Python ``hash()`` is
used, so digests are stable across processes and PYTHONHASHSEED values.
"""

from __future__ import annotations

import hashlib
from itertools import repeat
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol.speedups import C as _C

MASK = (1 << 64) - 1
U64 = npt.NDArray[np.uint64]

_K_SPEC = np.uint64(0x9E3779B97F4A7C15)
_K_COMP = np.uint64(0xC2B2AE3D27D4EB4F)
_K_POS = np.uint64(0x165667B19E3779F9)
_K_HANDLE = np.uint64(0xD6E8FEB86659FD93)
_K_GROUP = np.uint64(0xFF51AFD7ED558CCD)
_K_TOKEN = np.uint64(0xC4CEB9FE1A85EC53)
_K_SCHED = np.uint64(0x27D4EB2F165667C5)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def mix64(x: npt.ArrayLike) -> U64:
    """splitmix64 finaliser over a uint64 array (array arithmetic wraps silently)."""
    z = np.array(x, dtype=np.uint64, ndmin=1)
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z


def _u64(a: npt.ArrayLike) -> U64:
    return np.asarray(a, dtype=np.int64).astype(np.uint64)


def _scalar(value: int) -> np.uint64:
    return np.uint64(value & MASK)


def total(terms: npt.NDArray[Any]) -> int:
    """Sum of terms mod 2**64 as a Python int."""
    return int(terms.sum(dtype=np.uint64)) & MASK if terms.size else 0


def spec_hash(encoded_spec: bytes) -> int:
    """64-bit content hash of a request's static data (its canonical encoding)."""
    return int.from_bytes(hashlib.blake2b(encoded_spec, digest_size=8).digest(), "little")


def spec_terms(handles: npt.ArrayLike, hashes: npt.ArrayLike) -> U64:
    return mix64(np.asarray(hashes, dtype=np.uint64) ^ (_u64(handles) * _K_SPEC))


def spec_term_int(handle: int, spec_hash: int) -> int:
    """:func:`spec_terms` of one handle."""
    return mix64_int(spec_hash ^ ((handle * _SPEC_I) & MASK))


#: handle_keys of handles 0..size-1, grown on demand up to KEY_CACHE_LIMIT handles (a key
#: depends on the handle alone, so one table serves every state in the process)
KEY_CACHE_LIMIT = 1 << 20
_key_cache: U64 = np.zeros(0, dtype=np.uint64)


def _handle_keys_uncached(handles: npt.ArrayLike) -> U64:
    return mix64(_u64(handles) * _K_COMP + _K_HANDLE) | np.uint64(1)


def handle_keys(handles: npt.ArrayLike) -> U64:
    """Odd 64-bit per-handle multipliers for the linear computed-token terms (from a
    process-wide table: one gather instead of a chain of numpy calls)."""
    global _key_cache
    h = np.asarray(handles, dtype=np.int64)
    if not h.size:
        return np.zeros(0, dtype=np.uint64)
    top = int(h.max())
    if int(h.min()) < 0 or top >= KEY_CACHE_LIMIT:
        return _handle_keys_uncached(h)
    keys = _key_cache  # one read: a thread growing the table swaps in a whole new one
    if top >= keys.size:
        keys = _handle_keys_uncached(np.arange(min(max(2 * top, 1024), KEY_CACHE_LIMIT),
                                               dtype=np.int64))
        if keys.size > _key_cache.size:
            _key_cache = keys
    return keys[h]


def computed_terms(handles: npt.ArrayLike, computed: npt.ArrayLike) -> U64:
    """``computed * key(handle)``: linear, so advancing a whole schedule by its
    scheduled counts adds one cacheable constant (Σ nsched·key) to the digest."""
    return _u64(computed) * handle_keys(handles)


def block_terms(handle: int, group: int, start: int, blocks: npt.ArrayLike) -> U64:
    """Terms of ``blocks`` at positions ``start..`` of one handle's table in ``group``."""
    b = _u64(blocks)
    return block_terms_rows(np.full(b.size, handle), group, np.arange(start, start + b.size), b)


def block_terms_rows(handles: npt.ArrayLike, group: int, positions: npt.ArrayLike,
                     blocks: npt.ArrayLike) -> U64:
    """Terms of block ids at (handle, position) pairs of ``group`` (aligned arrays)."""
    salt = _u64(handles) * _K_HANDLE + _scalar(group * int(_K_GROUP))
    return mix64(_u64(blocks) * _K_SPEC + _u64(positions) * _K_POS + salt)


def token_terms(handles: npt.ArrayLike, positions: npt.ArrayLike, tokens: npt.ArrayLike) -> U64:
    """Terms of output tokens (aligned arrays of handle, position, token)."""
    return mix64(_u64(tokens) * _K_TOKEN + _u64(positions) * _K_POS + _u64(handles) * _K_SPEC)


def schedule_keys(handles: npt.ArrayLike, positions: npt.ArrayLike | None = None) -> U64:
    """Odd multipliers of the scheduled counts, per (handle, position); positions
    ``0..`` by default."""
    h = _u64(handles)
    pos = np.arange(h.size, dtype=np.uint64) if positions is None else _u64(positions)
    return mix64(h * _K_SCHED + pos * _K_POS) | np.uint64(1)


def schedule_term(handles: npt.ArrayLike, num_scheduled: npt.ArrayLike) -> int:
    """``(count + 1) * skey(handle, position)`` summed: linear in the counts, so a count
    change costs one product; the ``+ 1`` keeps a zero count's place in the term."""
    if _C is not None:  # one C loop instead of a chain of numpy calls
        got: int | None = _C.keyed_sum(_as_list(handles), _as_list(num_scheduled),
                                       int(_K_SCHED), 0, int(_K_POS), 1)
        if got is not None:
            return got
    return total((_u64(num_scheduled) + np.uint64(1)) * schedule_keys(handles))


def _as_list(values: npt.ArrayLike) -> object:
    """An array's items as Python ints for the C loops (anything else passes through:
    C refuses what is not a list of ints, and the numpy path decides)."""
    return values.tolist() if isinstance(values, np.ndarray) and values.ndim == 1 else values


# -- the same terms on Python ints, for the few items of a common step ---------------------
# (each numpy call costs a microsecond or more; a handful of items is cheaper in Python)
SMALL = 16  # at most this many items: Python ints (numpy costs ~15 µs a call chain)

_M1I, _M2I = int(_M1), int(_M2)
_SPEC_I, _COMP_I, _POS_I = int(_K_SPEC), int(_K_COMP), int(_K_POS)
_HANDLE_I, _GROUP_I = int(_K_HANDLE), int(_K_GROUP)
_SCHED_I = int(_K_SCHED)


def mix64_int(z: int) -> int:
    """:func:`mix64` of one value < 2**64."""
    z ^= z >> 30
    z = (z * _M1I) & MASK
    z ^= z >> 27
    z = (z * _M2I) & MASK
    return z ^ (z >> 31)


def handle_key_int(h: int) -> int:
    return mix64_int((h * _COMP_I + _HANDLE_I) & MASK) | 1


def computed_change(handles: list[int], deltas: list[int]) -> int:
    """Digest change of adding ``deltas`` to the computed counts of ``handles``."""
    if _C is not None:
        got: int | None = _C.keyed_sum(handles, deltas, _COMP_I, _HANDLE_I, 0, 0)
        if got is not None:
            return got
    if len(handles) > SMALL:
        d = np.asarray(deltas, dtype=np.int64).astype(np.uint64)
        return total(d * handle_keys(handles))
    return sum(d * handle_key_int(h) for h, d in zip(handles, deltas, strict=True)) & MASK


def schedule_key_list(handles: list[int]) -> list[int]:
    """:func:`schedule_keys` of a schedule (positions ``0..``) as Python ints (one C loop
    when it takes the list: numpy's call chain costs ~10 µs on a small schedule)."""
    if _C is not None:
        got: list[int] | None = _C.key_list(handles, _SCHED_I, 0, _POS_I)
        if got is not None:
            return got
    return schedule_keys(handles).tolist()  # type: ignore[no-any-return]


def handle_key_list(handles: list[int]) -> list[int]:
    """:func:`handle_keys` as Python ints (one C loop when it takes the list)."""
    if _C is not None:
        got: list[int] | None = _C.key_list(handles, _COMP_I, _HANDLE_I, 0)
        if got is not None:
            return got
    if len(handles) <= SMALL:  # a few: Python ints beat numpy's call chain
        return list(map(handle_key_int, handles))
    return handle_keys(handles).tolist()  # type: ignore[no-any-return]


def schedule_key_int(h: int, position: int) -> int:
    """:func:`schedule_keys` of one (handle, position)."""
    return mix64_int((h * _SCHED_I + position * _POS_I) & MASK) | 1


def schedule_change(handles: list[int], positions: list[int], old: list[int],
                    new: list[int]) -> int:
    """Digest change of the scheduled counts at ``positions`` going from ``old`` to ``new``."""
    if len(handles) > SMALL:
        moved = np.asarray(new, dtype=np.int64) - np.asarray(old, dtype=np.int64)
        return total(moved.astype(np.uint64) * schedule_keys(handles, positions))
    return sum((b - a) * schedule_key_int(h, p)
               for h, p, a, b in zip(handles, positions, old, new, strict=True)) & MASK


def block_row_sums(handle: int, group: int, start: int, blocks: list[int]) -> int:
    """Sum of :func:`block_terms` of one row's ``blocks`` at ``start..`` (Python ints;
    :func:`mix64_int` inlined: a call per block would cost a third more)."""
    salt = (handle * _HANDLE_I + ((group * _GROUP_I) & MASK)) & MASK
    total, pos = 0, start * _POS_I
    for b in blocks:
        z = (b * _SPEC_I + pos + salt) & MASK
        z ^= z >> 30
        z = (z * _M1I) & MASK
        z ^= z >> 27
        z = (z * _M2I) & MASK
        total += z ^ (z >> 31)
        pos += _POS_I
    return total & MASK


def group_salt(group: int) -> int:
    """The KV group's share of every block term of that group."""
    return (group * _GROUP_I) & MASK


#: a block term's multipliers: (block id, position in the table, handle)
BLOCK_KEYS = (_SPEC_I, _POS_I, _HANDLE_I)


def block_unit_terms(handles: list[int], group: int, positions: list[int],
                     blocks: list[int]) -> list[int]:
    """:func:`block_terms_rows` of one block per row (aligned lists, Python ints;
    :func:`mix64_int` inlined)."""
    g = (group * _GROUP_I) & MASK
    if _C is not None:
        terms: list[int] | None = _C.unit_terms(handles, positions, blocks, g, _SPEC_I,
                                                _POS_I, _HANDLE_I)
        if terms is not None:
            return terms
    return unit_terms_py(handles, g, positions, blocks)


def unit_terms_py(handles: list[int], g: int, positions: list[int],
                  blocks: list[int]) -> list[int]:
    """:func:`block_unit_terms` without the speedups (the reference; ``g`` the group's
    salt)."""
    out = []
    for h, p, b in zip(handles, positions, blocks, strict=True):
        z = (b * _SPEC_I + p * _POS_I + h * _HANDLE_I + g) & MASK
        z ^= z >> 30
        z = (z * _M1I) & MASK
        z ^= z >> 27
        z = (z * _M2I) & MASK
        out.append(z ^ (z >> 31))
    return out


def row_terms(handles: list[int], group: int, starts: list[int], counts: list[int],
              values: list[int]) -> list[int]:
    """Each row's block-term sum: row ``i`` appends ``counts[i]`` of the flat ``values``
    to handle ``handles[i]``'s table in ``group`` at ``starts[i]``.  Python ints; rows
    of one block each in C (:mod:`protocol.speedups`), else with numpy past :data:`SMALL`."""
    if len(values) == len(handles) and 0 not in counts:  # one block per row: a term each
        if len(values) > SMALL and _C is None:
            return block_terms_rows(handles, group, starts, values).tolist()  # type: ignore[no-any-return]
        return block_unit_terms(handles, group, starts, values)
    terms, at = [], 0
    if _C is not None and len(values) > len(handles):  # whole rows: a term per block in C
        hs: list[int] = []
        positions: list[int] = []
        for h, start, n in zip(handles, starts, counts, strict=True):
            hs += repeat(h, n)
            positions += range(start, start + n)
        units = block_unit_terms(hs, group, positions, values)
        for n in counts:
            terms.append(sum(units[at:at + n]) & MASK)
            at += n
        return terms
    for h, start, n in zip(handles, starts, counts, strict=True):
        terms.append(block_row_sums(h, group, start, values[at:at + n]))
        at += n
    return terms
