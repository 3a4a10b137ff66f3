"""The replicated-state digest: a 64-bit sum of per-item terms, updated in O(changes).

digest = Σ spec terms + Σ computed-token terms + Σ block terms + Σ token terms
         + schedule term   (all mod 2**64; SPEC.md §5)

A term is a splitmix64 mix of an item keyed by its handle and position, or (the
computed and scheduled counts) the count times such a mixed odd key, so a change
anywhere changes the digest with overwhelming probability, and adding or removing
one item changes only its own term.  Counts enter linearly: advancing a whole
schedule by its scheduled counts adds one cached constant.  No Python ``hash()``:
digests are stable across processes.  Each function has a scalar form (Python ints,
for the few items of a common step) and an array form (numpy, for many); both give
the same values.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import numpy.typing as npt

from protocol import kernels

MASK = (1 << 64) - 1
U64 = npt.NDArray[np.uint64]
I64 = npt.NDArray[np.int64]

K_SPEC = 0x9E3779B97F4A7C15
K_COMP = 0xC2B2AE3D27D4EB4F
K_POS = 0x165667B19E3779F9
K_HANDLE = 0xD6E8FEB86659FD93
K_GROUP = 0xFF51AFD7ED558CCD
K_TOKEN = 0xC4CEB9FE1A85EC53
K_SCHED = 0x27D4EB2F165667C5
#: added inside every block and token term, so no item mixes zero (mix64(0) = 0)
K_ROW = 0x2545F4914F6CDD1D
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U = np.uint64
_NM1, _NM2 = _U(_M1), _U(_M2)
_S30, _S27, _S31 = _U(30), _U(27), _U(31)

#: at most this many items: Python ints (a numpy call chain costs microseconds)
SMALL = 24


def mix64_int(z: int) -> int:
    """splitmix64's finaliser of one value < 2**64."""
    z ^= z >> 30
    z = (z * _M1) & MASK
    z ^= z >> 27
    z = (z * _M2) & MASK
    return z ^ (z >> 31)


def mix64(z: U64) -> U64:
    """:func:`mix64_int` over a uint64 array, in place (uint64 arithmetic wraps)."""
    z ^= z >> _S30
    z *= _NM1
    z ^= z >> _S27
    z *= _NM2
    z ^= z >> _S31
    return z


def u64(values: Any) -> U64:
    """Integers as uint64 (two's complement for negatives), a fresh array."""
    return np.asarray(values, dtype=np.int64).astype(np.uint64)


def total(terms: U64) -> int:
    """Sum of terms mod 2**64."""
    if terms.size <= SMALL:
        return sum(terms.tolist()) & MASK
    return int(terms.sum(dtype=np.uint64))


# -- specs ---------------------------------------------------------------------------
def spec_term(handle: int, raw: Any) -> int:
    """The term of a request whose spec travelled as ``raw`` (its exact wire bytes)."""
    h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return mix64_int(h ^ ((handle * K_SPEC) & MASK))


# -- computed counts: count * key(handle) ----------------------------------------------
def handle_key(h: int) -> int:
    """``mix64(h * K_COMP + K_HANDLE) | 1`` (remembered: handles are small and reused)."""
    if h < len(_HANDLE_KEYS):
        return _HANDLE_KEYS[h]
    if not 0 <= h < 1 << 25:
        return mix64_int((h * K_COMP + K_HANDLE) & MASK) | 1
    grow = np.arange(len(_HANDLE_KEYS), max(2 * len(_HANDLE_KEYS), h + 1, 1024), dtype=np.uint64)
    _HANDLE_KEYS.extend((mix64(grow * _U(K_COMP) + _U(K_HANDLE)) | _U(1)).tolist())
    return _HANDLE_KEYS[h]


_HANDLE_KEYS: list[int] = []  # handle_key(h) by h, as far as handles have reached


def keyed_sum(handles: I64, counts: I64) -> int:
    """Σ counts[i] * key(handles[i]) mod 2**64 (the computed terms, and the advance)."""
    got = kernels.keyed_sum(handles, counts, K_COMP, 0, K_HANDLE, 0)
    if got is not None:
        return got
    return keyed_sum_py(handles, counts, K_COMP, 0, K_HANDLE, 0)


def keyed_sum_py(handles: I64, counts: I64, k_handle: int, k_pos: int, k_add: int,
                 plus: int) -> int:
    """Σ (counts[i] + plus) * (mix64(handles[i] * k_handle + i * k_pos + k_add) | 1) mod
    2**64: the reference of the C kernel (numpy past :data:`SMALL` items)."""
    if handles.size <= SMALL:
        hs: list[int] = handles.tolist()
        cs: list[int] = counts.tolist()
        return sum((c + plus) * (mix64_int((h * k_handle + i * k_pos + k_add) & MASK) | 1)
                   for i, (h, c) in enumerate(zip(hs, cs, strict=True))) & MASK
    pos = np.arange(handles.size, dtype=np.uint64)
    keys = mix64(u64(handles) * _U(k_handle) + pos * _U(k_pos) + _U(k_add)) | _U(1)
    return total((counts.astype(np.uint64) + _U(plus)) * keys)


# -- blocks: mix(block*K_SPEC + position*K_POS + handle*K_HANDLE + group*K_GROUP + K_ROW) -
def block_row_terms(handles: list[int], group: int, starts: list[int], counts: list[int],
                    values: list[int]) -> list[int]:
    """Each row's block-term sum: row ``i`` puts ``counts[i]`` of the flat ``values`` at
    positions ``starts[i]..`` of handle ``handles[i]``'s table in ``group``."""
    salt = (group * K_GROUP + K_ROW) & MASK
    sums = kernels.row_mix_sums(handles, starts, counts, values, K_SPEC, K_POS, K_HANDLE, salt)
    if sums is not None:
        return sums
    if len(values) > SMALL:
        rows = np.repeat(np.arange(len(handles)), counts)
        offsets = np.cumsum(counts) - np.asarray(counts)
        at_ = np.asarray(starts, dtype=np.int64)[rows] + np.arange(len(values)) - offsets[rows]
        hs = np.asarray(handles, dtype=np.int64)[rows]
        z = mix64(u64(values) * _U(K_SPEC) + u64(at_) * _U(K_POS) + u64(hs) * _U(K_HANDLE)
                  + _U(salt))
        out = np.zeros(len(handles), dtype=np.uint64)
        np.add.at(out, rows, z)
        return out.tolist()  # type: ignore[no-any-return]
    return row_sums_py(handles, starts, counts, values, K_SPEC, K_POS, K_HANDLE, salt)


def row_sums_py(handles: list[int], starts: list[int], counts: list[int], values: list[int],
                k_value: int, k_pos: int, k_handle: int, salt: int) -> list[int]:
    """Per row, Σ mix64(v * k_value + p * k_pos + handle * k_handle + salt) mod 2**64 over
    its values at positions start, start + 1, ...: the reference of the C kernel."""
    out, at = [], 0
    for h, start, n in zip(handles, starts, counts, strict=True):
        base, pos, acc = (h * k_handle + salt) & MASK, start * k_pos, 0
        for v in values[at:at + n]:
            acc += mix64_int((v * k_value + pos + base) & MASK)
            pos += k_pos
        out.append(acc & MASK)
        at += n
    return out


# -- tokens: mix(token*K_TOKEN + position*K_POS + handle*K_SPEC + K_ROW) ------------------
def token_sums(handles: I64, starts: I64, counts: I64, values: I64) -> U64:
    """Each row's token-term sum (row ``i``: ``counts[i]`` of the flat ``values`` at
    positions ``starts[i]..`` of handle ``handles[i]``'s history), as uint64."""
    if not handles.size:
        return np.zeros(0, dtype=np.uint64)
    got = kernels.row_mix_sums(handles.tolist(), starts.tolist(), counts.tolist(),
                               values.tolist(), K_TOKEN, K_POS, K_SPEC, K_ROW)
    if got is not None:
        return np.array(got, dtype=np.uint64)
    rows = np.repeat(np.arange(handles.size), counts)
    offsets = np.cumsum(counts) - counts
    pos = np.repeat(starts - offsets, counts) + np.arange(values.size)
    z = mix64(u64(values) * _U(K_TOKEN) + u64(pos) * _U(K_POS) + u64(handles[rows])
              * _U(K_SPEC) + _U(K_ROW))
    if values.size == handles.size and bool((counts == 1).all()):  # one token a row
        return z
    sums = np.zeros(handles.size, dtype=np.uint64)
    np.add.at(sums, rows, z)
    return sums


# -- the schedule: Σ (count + 1) * skey(handle, position) -------------------------------
def schedule_key(h: int, position: int) -> int:
    return mix64_int((h * K_SCHED + position * K_POS) & MASK) | 1


def schedule_term(handles: I64, counts: I64) -> int:
    """``(count + 1) * skey(handle, position)`` summed: linear in the counts (a count
    change costs one product); the ``+ 1`` keeps a zero count's place in the term."""
    got = kernels.keyed_sum(handles, counts, K_SCHED, K_POS, 0, 1)
    if got is not None:
        return got
    return keyed_sum_py(handles, counts, K_SCHED, K_POS, 0, 1)
