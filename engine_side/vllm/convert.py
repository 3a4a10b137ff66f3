"""vLLM objects ⇄ deltacast's typed ones, plus what both adapter ends must share.

Shared by the engine-side encoder and the worker-side decoder (parameter
conversion, ``SamplingParams`` ⇄ ``SamplingSpec`` ..., is :mod:`engine_side.vllm.params`):
token references,
the per-step memory whose predictions both ends compute identically, and the
sealing of opaque connector objects (:mod:`protocol.seal`: the only pickle in the
adapter, unpickled only after its MAC verified).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from operator import itemgetter
from typing import Any

import numpy as np

from engine_side.vllm.schema import TokenRef
from protocol.errors import LocalProtocolError, RemoteProtocolError
from protocol.packing import pack_sints, pack_uints, unpack_sints, unpack_uint_list
from protocol.request import IntArray, RequestSpec
from protocol.seal import BadSeal, Opener, Sealer
from protocol.speedups import C as _C

#: the seal labels of the step channel's opaque objects (SPEC §16): connector metadata
#: in a step's extension (engine → every rank), connector outputs in a reply (the
#: output rank → engine: no other rank sends replies)
STEP_LABEL, REPLY_LABEL = b"step", b"reply"


# ---------------------------------------------------------------- token references
class TokenLedger:
    """Tokens the workers are known to hold per live request (sampled, as replied)."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def extend(self, req_id: str, tokens: list[int]) -> None:
        self.tokens.setdefault(req_id, []).extend(tokens)

    def get(self, req_id: str) -> list[int]:
        return self.tokens.get(req_id, [])

    def forget(self, req_id: str) -> None:
        self.tokens.pop(req_id, None)


def _common(a: list[int], b: IntArray | list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def make_ref(tokens: list[int], prompt: IntArray | None, ledger: list[int]) -> TokenRef:
    """``tokens`` as a prompt prefix, then a ledger prefix, then an explicit tail."""
    p = 0 if prompt is None else _common(tokens, prompt)
    full_prompt = prompt is not None and p == len(prompt)
    held = _common(tokens[p:], ledger) if full_prompt else 0
    rest = tokens[p + held:]
    return TokenRef(p, held, pack_sints(rest) if rest else b"")


def resolve_ref(ref: TokenRef, prompt: IntArray | None, ledger: list[int]) -> list[int]:
    if ref.p > (0 if prompt is None else len(prompt)) or ref.l > len(ledger):
        raise RemoteProtocolError("token reference beyond what this worker holds",
                                  prompt=ref.p, ledger=ref.l)
    head = [] if prompt is None else prompt[:ref.p].tolist()
    tail = unpack_sints(ref.t).tolist() if ref.t else []
    return head + ledger[:ref.l] + tail


# ---------------------------------------------------------------- shared step memory
class StepMemory:
    """What both ends remember of previous steps; predictions are computed from it only."""

    def __init__(self, ledger: TokenLedger | None = None) -> None:
        self.known: set[str] = set()  # scheduled at least once, not finished since
        self.prompt: dict[str, IntArray | None] = {}
        self.plen: dict[str, int] = {}
        self.table_len: list[dict[str, int]] = []  # per KV group (decoder side)
        self.prev_batch: set[str] = set()
        self._plen_ids: list[str] | None = None
        self._plen_col: IntArray = np.zeros(0, dtype=np.int64)
        self.mrv2 = False  # Model Runner V2 stream (new requests carry prefill_token_ids)
        self.ledger = ledger

    def finish(self, ids: Iterable[str]) -> None:
        for rid in ids:
            self._plen_ids = None
            self.known.discard(rid)
            self.prompt.pop(rid, None)
            self.plen.pop(rid, None)
            for lens in self.table_len:
                lens.pop(rid, None)
            if self.ledger is not None:
                self.ledger.forget(rid)

    def remember(self, spec: RequestSpec) -> None:
        """A (re)sent request's prompt, for token references and output predictions."""
        prompt = spec.prompt_token_ids
        self._plen_ids = None
        self.prompt[spec.req_id] = prompt
        if prompt is not None:
            self.plen[spec.req_id] = int(prompt.size)
        else:
            embeds = spec.prompt_embeds
            self.plen[spec.req_id] = 0 if embeds is None else int(embeds.shape[0])

    def held(self, rid: str) -> list[int]:
        return [] if self.ledger is None else self.ledger.get(rid)

    def predicted_outputs(self, ids: list[str], computed: IntArray) -> IntArray:
        """num_output_tokens of cached requests: tokens past the prompt, last one uncomputed."""
        if ids != self._plen_ids:  # steady decode repeats the list: reuse the column
            self._plen_ids = list(ids)
            self._plen_col = np.fromiter(map(self.plen.__getitem__, ids), np.int64, len(ids))
        return np.maximum(0, computed - self._plen_col + 1)

    def output_departures(self, ids: list[str], computed: IntArray,
                          outputs: Any) -> tuple[bytes, bytes] | None:
        """(positions, deltas) packed where cached requests' ``outputs`` depart from
        :meth:`predicted_outputs`; None when none does."""
        diff = np.asarray(outputs, dtype=np.int64) - self.predicted_outputs(ids, computed)
        off = np.flatnonzero(diff)
        return (pack_uints(off), pack_sints(diff[off])) if off.size else None

    def record_output(self, out: Any) -> None:
        """A ModelRunnerOutput's sampled tokens into the ledger (nothing without one)."""
        ledger, known = self.ledger, self.known
        if ledger is None:
            return
        for rid, tokens in zip(out.req_ids, out.sampled_token_ids, strict=False):
            if rid in known:
                ledger.extend(rid, tokens)


def check_scheduled(so: Any) -> None:
    """Raise LocalProtocolError, naming the ids, unless ``num_scheduled_tokens`` (whose
    keys order the batch) names each of the step's new and cached requests once and
    nothing else: vLLM's scheduler makes no other shape."""
    cached = so.scheduled_cached_reqs.req_ids
    new = [nr.req_id for nr in so.scheduled_new_reqs]
    keys = so.num_scheduled_tokens.keys()
    ids = set(cached).union(new)
    if len(ids) == len(cached) + len(new) == len(keys) and ids == keys:
        return
    repeated = sorted(rid for rid, n in Counter([*cached, *new]).items() if n > 1)
    raise LocalProtocolError(
        "num_scheduled_tokens must name each new and cached request once",
        repeated=repeated[:8], unscheduled=sorted(ids - keys)[:8],
        unknown=sorted(keys - ids)[:8])


def cached_order(positions: list[int], batch: list[str], resumed: set[str]) -> list[int]:
    """vLLM lists running requests first, then resumed ones (each in batch order)."""
    if not resumed:
        return positions
    return ([i for i in positions if batch[i] not in resumed]
            + [i for i in positions if batch[i] in resumed])


# ---------------------------------------------------------------- replies' lists
def single_items(rows: Any) -> list[Any] | None:
    """``[row[0] for row in rows]`` when ``rows`` is a list of one-item lists (a step's
    sampled tokens, one per request), else None (C when built)."""
    if _C is not None:
        return _C.single_items(rows)
    return single_items_py(rows)


def single_items_py(rows: Any) -> list[Any] | None:
    """:func:`single_items` without the speedups (the reference)."""
    if type(rows) is not list or any(type(r) is not list or len(r) != 1 for r in rows):
        return None
    return [r[0] for r in rows]


def singletons(items: list[Any]) -> list[list[Any]]:
    """``[[item] for item in items]``: fresh one-item lists (C when built)."""
    made = _C.singletons(items) if _C is not None else None
    return made if made is not None else [[item] for item in items]


def draft_rows(drafts: Any, pos: dict[str, int], n: int) -> tuple[list[int], list[int]] | None:
    """A step's draft tokens (``scheduled_spec_decode_tokens``) as (tokens per batch
    position, every token in dict order), ``pos`` mapping ids to positions; None unless
    non-empty lists keyed in strictly increasing batch order.  One C call when built."""
    got = _C.draft_rows(drafts, pos, n) if _C is not None else None
    return got if got is not None else draft_rows_py(drafts, pos, n)


def draft_rows_py(drafts: Any, pos: dict[str, int], n: int,
                  ) -> tuple[list[int], list[int]] | None:
    """:func:`draft_rows` without the speedups (the reference)."""
    if type(drafts) is not dict:
        return None
    lengths, flat, last = [0] * n, [], -1
    for key, row in drafts.items():
        p = pos.get(key)
        if type(p) is not int or not last < p < n or type(row) is not list or not row:
            return None
        lengths[p] = len(row)
        flat += row
        last = p
    return lengths, flat


def split_rows(keys: list[str], lengths: list[int], flat: list[int]) -> dict[str, list[int]]:
    """``{keys[i]: row i}`` for the rows of non-zero length, rows consecutive in ``flat``
    (fresh lists; a step's draft tokens by request); one C call when built.  The caller
    vouches that the lengths are one per key and add up to ``len(flat)``."""
    got = _C.split_rows(keys, lengths, flat) if _C is not None else None
    return got if got is not None else split_rows_py(keys, lengths, flat)


def split_rows_py(keys: list[str], lengths: list[int], flat: list[int]) -> dict[str, list[int]]:
    """:func:`split_rows` without the speedups (the reference)."""
    out, start = {}, 0
    for key, n in zip(keys, lengths, strict=True):
        if n:
            out[key] = flat[start:start + n]
            start += n
    return out


def index_is_positions(index: dict[str, int], req_ids: list[str]) -> bool:
    """``list(index) == req_ids`` and its values are ``0..n-1`` (vLLM's usual
    req_id_to_index), without building the lists when C is built."""
    if _C is not None:
        got = _C.dict_matches(index, req_ids, list(range(len(req_ids))))
        if got is not None:
            return got == 2
    return list(index) == req_ids and list(index.values()) == list(range(len(index)))


# ---------------------------------------------------------------- sealing
class ChannelSeals:
    """One end's seals of the step channel's opaque objects: a Sealer of the label it
    ``sends`` and an Opener of the one it ``receives`` (neither without a secret)."""

    def __init__(self, secret: bytes | None, sends: bytes, receives: bytes) -> None:
        self.sealer = Sealer(secret, sends) if secret else None
        self.opener = Opener(secret, receives) if secret else None

    def seal(self, objects: dict[str, Any]) -> bytes:
        """``objects`` sealed (``b""``: none); LocalProtocolError without a secret."""
        if not objects:
            return b""
        if self.sealer is None:
            raise LocalProtocolError("connector objects need a shared secret",
                                     names=sorted(objects))
        return self.sealer.seal(objects)

    def open(self, blob: bytes) -> dict[str, Any]:
        """The objects of a sealed field (``{}`` for an empty field: nothing sealed, not
        opened); BadSeal for a blob refused, or for any blob without a secret."""
        if not blob:
            return {}
        if self.opener is None:
            raise BadSeal("a sealed field, but no secret to open it with")
        return self.opener.open(blob)


# ---------------------------------------------------------------- id references
class RefTable:
    """Request ids as small ints: a position in a step's batch, else len(batch) + name index."""

    def __init__(self, batch: list[str], names: list[str]) -> None:
        self.batch = batch
        self.names = names
        self._pos: dict[str, int] | None = None

    def _positions(self) -> dict[str, int]:
        if self._pos is None:
            self._pos = dict(zip(self.batch, range(len(self.batch)), strict=True))
        return self._pos

    def ref(self, rid: str) -> int:
        pos = self._positions()
        i = pos.get(rid)
        if i is None:
            i = len(self.batch) + len(self.names)
            pos[rid] = i
            self.names.append(rid)
        return i

    def refs(self, ids: list[str]) -> list[int]:
        """:meth:`ref` of each id (C-level maps when the table knows them all)."""
        if not ids:
            return []  # (the position map costs microseconds to build: not for nothing)
        known = list(map(self._positions().get, ids))
        return list(map(self.ref, ids)) if None in known else known  # type: ignore[return-value]

    def pack(self, ids: list[str]) -> bytes:
        return pack_uints(self.refs(ids))

    def pairs(self, by_id: dict[str, Any]) -> tuple[tuple[int, Any], ...]:
        """A per-request dict as (ref, value) pairs, in the dict's order."""
        return tuple(zip(self.refs(list(by_id)), by_id.values(), strict=True))

    def named(self, pairs: tuple[tuple[int, Any], ...]) -> dict[str, Any]:
        """Inverse of :meth:`pairs` (refs checked as :meth:`name` checks them)."""
        if not pairs:
            return {}
        names = self.names_of(list(map(itemgetter(0), pairs)))
        return dict(zip(names, map(itemgetter(1), pairs), strict=True))

    def name(self, ref: int) -> str:
        n = len(self.batch)
        if 0 <= ref < n:
            return self.batch[ref]
        if ref < 0 or ref - n >= len(self.names):
            raise RemoteProtocolError("request reference out of range", ref=ref)
        return self.names[ref - n]

    def names_of(self, refs: list[int]) -> list[str]:
        """:meth:`name` of each ref."""
        if not refs or (min(refs) >= 0 and max(refs) < len(self.batch)):
            return list(map(self.batch.__getitem__, refs))  # batch positions only: C-level
        return list(map(self.name, refs))

    def resolve(self, packed: bytes) -> list[str]:
        return self.names_of(unpack_uint_list(packed))
