"""The executor extension: what an executor channel carries beside the core messages.

The vLLM executor profile (SPEC.md §16) sends, with each step's Delta, a
:class:`StepExt` in the body's ``x`` slot: the step's departures from what the
receiver predicts from the core state and its own memory (which rows are new, list
orders, per-request output counts, rare flags), nothing when every prediction holds.
Replies (:class:`ReplyMsg`) name requests by position in the batch of the step they
answer.  Token lists a receiver already holds travel as :class:`TokenRef`.  Names here
are the protocol's own; the adapters (``engine_side.vllm``, ``worker_side.vllm``) map
them to and from the executor's objects.  Pure: no I/O.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any, Literal

import msgspec
import numpy as np

from protocol import kernels
from protocol.errors import (
    DECODE_ERRORS,
    LocalProtocolError,
    MalformedMessage,
    RemoteProtocolError,
    malformed,
)
from protocol.packing import pack_sints, pack_uints, unpack_sints, unpack_uint_list


class _Map(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Base: a sparse map, defaults omitted."""


class TokenRef(_Map, frozen=True):
    """A token list as ``prompt[:p] + tail``: a prefix of the request's prompt, which
    the receiver holds, then the tokens it does not."""

    p: int = 0
    t: bytes = b""


#: sampling-parameter float fields the executor also accepts as ints (NewFix.int_floats)
FloatField = Literal["presence_penalty", "frequency_penalty", "repetition_penalty",
                     "temperature", "top_p", "min_p"]
#: the dtype of an integer prompt-logprob id array: either byte order ("": a list)
IntDtype = Literal["", "|i1", "<i2", "<i4", "<i8", ">i2", ">i4", ">i8",
                   "|u1", "<u2", "<u4", "<u8", ">u2", ">u4", ">u8"]


class NewFix(_Map, frozen=True):
    """Per new request (``i``: its index among the step's new requests): what its spec
    cannot say exactly.  Typed names: a receiver decodes no other (MalformedMessage)."""

    i: int
    int_floats: tuple[FloatField, ...] = msgspec.field(default=(), name="f")
    logprob_ids_dtype: IntDtype = msgspec.field(default="", name="d")
    lora_3d: bool | None = msgspec.field(default=None, name="l3")
    replay_start: int = msgspec.field(default=0, name="r")


class StepExt(_Map, frozen=True):
    """A step's departures from the receiver's predictions (SPEC §16, StepExt)."""

    kv_groups: int = msgspec.field(default=0, name="kg")
    cached_order: bytes = msgspec.field(default=b"", name="co")
    out_pos: bytes = msgspec.field(default=b"", name="op")
    out_delta: bytes = msgspec.field(default=b"", name="od")
    new_tokens: tuple[bytes, bytes] | None = msgspec.field(default=None, name="nt")
    all_keys: bytes = msgspec.field(default=b"", name="ak")
    all_tokens: tuple[TokenRef, ...] = msgspec.field(default=(), name="at")
    prefill: tuple[TokenRef | None, ...] = msgspec.field(default=(), name="pf")
    fixes: tuple[NewFix, ...] = msgspec.field(default=(), name="fx")
    restored: tuple[tuple[int, bytes], ...] = msgspec.field(default=(), name="ro")
    total: int = msgspec.field(default=-1, name="tt")
    preempted_none: bool = msgspec.field(default=False, name="pn")
    enc_stats: tuple[int, int] | None = msgspec.field(default=None, name="es")
    invalid_spec: dict[str, int] | None = msgspec.field(default=None, name="is")
    sync_kv: bool = msgspec.field(default=False, name="sy")
    block_copies: bytes | None = msgspec.field(default=None, name="bc")
    prefix_blocks: bytes | None = msgspec.field(default=None, name="cb")
    sealed: bytes = msgspec.field(default=b"", name="k")


NO_EXT = StepExt()
_EXT_ENCODER = msgspec.msgpack.Encoder()
_EXT_DECODER = msgspec.msgpack.Decoder(StepExt)


def encode_ext(ext: StepExt) -> bytes:
    """A StepExt's bytes for the Delta's ``x`` slot (empty when it departs from nothing)."""
    return b"" if ext == NO_EXT else _EXT_ENCODER.encode(ext)


def decode_ext(raw: bytes) -> StepExt:
    """The StepExt of an ``x`` slot (NO_EXT when empty); MalformedMessage for bad bytes."""
    if not raw:
        return NO_EXT

    try:
        return _EXT_DECODER.decode(raw)
    except DECODE_ERRORS as exc:
        raise malformed("bad step extension", exc) from exc


# ---------------------------------------------------------------- token references
def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


def make_ref(tokens: list[int], prompt: list[int] | None) -> TokenRef:
    """``tokens`` as a prefix of ``prompt`` and an explicit tail."""
    p = 0 if prompt is None else _common(tokens, prompt)
    rest = tokens[p:]
    return TokenRef(p, pack_sints(rest) if rest else b"")


def resolve_ref(ref: TokenRef, prompt: list[int] | None) -> list[int]:
    """The tokens ``ref`` stands for; MalformedMessage for a prefix longer than the prompt."""
    if not 0 <= ref.p <= (0 if prompt is None else len(prompt)):
        raise MalformedMessage("token reference beyond the prompt", prefix=ref.p)
    head = [] if prompt is None else prompt[:ref.p]
    return head + (unpack_sints(ref.t).tolist() if ref.t else [])


# ---------------------------------------------------------------- output counts
class OutputCounts:
    """Each live request's output-token count as both ends predict it: ``computed -
    prompt + 1`` (never below 0: the last sampled token is not computed yet) plus the
    request's offset, the last departure seen (so a constant offset -- async scheduling
    -- departs once).  Indexed by handle; the same updates at both ends.  The per-row
    columns of the last handle array are kept while it is the same object (a schedule
    array is replaced, never edited, when it changes)."""

    def __init__(self) -> None:
        self.plen = np.zeros(64, dtype=np.int64)
        self.offset = np.zeros(64, dtype=np.int64)
        self._rows: tuple[Any, Any, Any] = (None, None, None)  # handles, 1 - plen, offset

    def add(self, h: int, prompt_len: int) -> None:
        if h >= self.plen.size:
            grow = max(2 * self.plen.size, h + 1)
            self.plen = np.concatenate([self.plen, np.zeros(grow - self.plen.size, np.int64)])
            self.offset = np.concatenate([self.offset,
                                          np.zeros(grow - self.offset.size, np.int64)])
        self.plen[h] = prompt_len
        self.offset[h] = 0
        self._rows = (None, None, None)

    def predict(self, handles: Any, computed: Any) -> Any:
        rows = self._rows
        if rows[0] is not handles:
            rows = self._rows = (handles, 1 - self.plen[handles], self.offset[handles])
        return np.maximum(computed + rows[1], 0) + rows[2]

    def learn(self, handles: Any, at: Any, deltas: Any) -> None:
        """Departures ``deltas`` at positions ``at`` of ``handles``: new offsets."""
        if len(at):
            self.offset[handles[at]] += deltas
            self._rows = (None, None, None)

    def departures(self, handles: Any, computed: Any, actual: list[int],
                   ) -> tuple[bytes, bytes] | None:
        """(positions, deltas) packed where ``actual`` departs from the prediction, the
        offsets learnt; None when none does."""
        predicted = self.predict(handles, computed)
        if len(actual) != predicted.size:
            raise LocalProtocolError("num_output_tokens is not one entry per cached request",
                                     entries=len(actual), requests=predicted.size)
        found = kernels.mismatches(actual, predicted)
        if not found:
            return None
        at = np.asarray(found, dtype=np.int64)
        diff = np.asarray([actual[p] for p in found], dtype=np.int64) - predicted[at]
        self.learn(handles, at, diff)
        return pack_uints(at), pack_sints(diff)

    @staticmethod
    def read(pos: bytes, delta: bytes, n: int) -> tuple[Any, Any] | None:
        """A step's departures (positions, deltas) checked against its ``n`` cached
        requests (None: none); MalformedMessage when they do not fit."""
        if not pos and not delta:
            return None
        at = np.asarray(unpack_uint_list(pos, limit=max(n, 1)), dtype=np.int64)
        d = unpack_sints(delta)
        if at.size != d.size or (at.size and int(at.max()) >= n):
            raise MalformedMessage("output departures do not fit the step",
                                   positions=at.size, deltas=d.size)
        return at, d

    def apply(self, handles: Any, computed: Any, departures: tuple[Any, Any] | None) -> Any:
        """The actual counts: the prediction plus the departures :meth:`read` gave (learnt)."""
        out = self.predict(handles, computed)
        if departures is not None and departures[0].size:
            at, d = departures
            out[at] += d
            self.learn(handles, at, d)
        return out


# ---------------------------------------------------------------- request references
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
        if not ids:
            return []
        known = list(map(self._positions().get, ids))
        return list(map(self.ref, ids)) if None in known else known  # type: ignore[return-value]

    def pack(self, ids: list[str]) -> bytes:
        return pack_uints(self.refs(ids))

    def pairs(self, by_id: dict[str, Any]) -> tuple[tuple[int, Any], ...]:
        """A per-request dict as (ref, value) pairs, in the dict's order."""
        return tuple(zip(self.refs(list(by_id)), by_id.values(), strict=True))

    def named(self, pairs: tuple[tuple[int, Any], ...]) -> dict[str, Any]:
        """Inverse of :meth:`pairs`."""
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
        if not refs or (min(refs) >= 0 and max(refs) < len(self.batch)):
            return list(map(self.batch.__getitem__, refs))
        return list(map(self.name, refs))

    def resolve(self, packed: bytes) -> list[str]:
        return self.names_of(unpack_uint_list(packed))


# ---------------------------------------------------------------- replies
class LogprobsWire(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Sampled or prompt logprobs (arrays travel as zero-copy frames)."""

    token_ids: Any
    logprobs: Any
    ranks: Any
    cu: list[int] | None = None
    cu_tensor: Any = None


class KVOutputWire(_Map, frozen=True):
    """A KV connector's output: typed id sets; its objects sealed."""

    sending: list[str] | None = msgspec.field(default=None, name="s")
    recving: list[str] | None = msgspec.field(default=None, name="r")
    invalid_blocks: list[int] = msgspec.field(default_factory=list, name="ib")
    failed: list[str] = msgspec.field(default_factory=list, name="fr")
    expected: int = msgspec.field(default=0, name="e")
    sealed: bytes = msgspec.field(default=b"", name="k")


class ReplyMsg(_Map, frozen=True):
    """A rank's output for step ``seq``; request ids as positions in that step's batch."""

    seq: int = msgspec.field(name="q")
    positions: bytes = msgspec.field(default=b"", name="p")
    names: tuple[str, ...] = msgspec.field(default=(), name="n")
    index_map: bytes | None = msgspec.field(default=None, name="x")
    counts: bytes = msgspec.field(default=b"", name="c")
    tokens: bytes = msgspec.field(default=b"", name="t")
    logprobs: LogprobsWire | None = msgspec.field(default=None, name="lp")
    prompt_lp: tuple[tuple[int, LogprobsWire | None], ...] = msgspec.field(default=(), name="pl")
    prompt_tid: tuple[tuple[int, Any], ...] = msgspec.field(default=(), name="pt")
    pooler: list[Any] | None = msgspec.field(default=None, name="po")
    kv: KVOutputWire | None = msgspec.field(default=None, name="kv")
    nans: tuple[tuple[int, int], ...] | None = msgspec.field(default=None, name="nn")
    masks: tuple[Any, Any, list[int] | None] | None = msgspec.field(default=None, name="sm")
    sealed: bytes = msgspec.field(default=b"", name="k")
    none: bool = msgspec.field(default=False, name="z")


def decode_frames(frames: list[Any], single: msgspec.msgpack.Decoder[Any], kind: type,
                  what: str) -> Any:
    """Frame 0 of a message of ``kind``, its tensors from the other frames (copied);
    ``single`` serves one-frame messages.  MalformedMessage naming ``what`` for frames
    that do not decode."""
    from protocol.tensors import make_ext_hook

    if not frames:
        raise MalformedMessage(f"{what}: no frames")
    decoder = single if len(frames) == 1 else \
        msgspec.msgpack.Decoder(kind, ext_hook=make_ext_hook(frames[1:], copy=True))
    try:
        return decoder.decode(frames[0])
    except DECODE_ERRORS as exc:
        raise malformed(f"{what} frames do not decode", exc) from exc
