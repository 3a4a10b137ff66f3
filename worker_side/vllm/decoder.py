"""Worker side: frames → vLLM ``SchedulerOutput``; ``ModelRunnerOutput`` → reply frames.

The decoder applies each step's Delta through the replicated state machine
(:class:`protocol.state.ReplicaState`, the digest checked) and makes the step's
SchedulerOutput straight from what the body named: the requests that joined (with
their whole tables), each cached request's new blocks and counts, the finished ids,
with the extension's departures from its predictions.  One path for every step; a
step where nothing joins or leaves reuses the last step's id list and count map.
Every call returns fresh containers (the runner keeps and extends ``block_ids`` lists,
``CachedRequestData`` caches a property, ``mm_features`` are rewritten in place).

Raises, always before the state changes (a refused step also leaves its seal unused):
MalformedMessage for frames that do not decode or extension lists that do not fit the
step (read between the state's two phases), InvalidDelta for a step out of order or
that does not apply, BadSeal for connector metadata whose MAC does not verify.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import msgspec
import numpy as np

from protocol import codec
from protocol.codec import Frame
from protocol.columns import I64
from protocol.errors import InvalidDelta, MalformedMessage
from protocol.ext import NewFix, OutputCounts, ReplyMsg, StepExt, decode_ext, resolve_ref
from protocol.messages import Delta, NewRequest, Spec
from protocol.packing import unpack_sint_list, unpack_uint_list
from protocol.seal import ChannelSeals
from protocol.state import STEADY, Applied, ReplicaState, RowSet
from protocol.tensors import make_enc_hook
from worker_side.shm_reader import ShmReader
from worker_side.vllm.grammar import GrammarDecoder
from worker_side.vllm.mm import StoreResolver, embeds_from_wire, item_from_wire, mask_from_wire
from worker_side.vllm.params import SamplingMaker, spec_to_lora, spec_to_pooling
from worker_side.vllm.replies import reply_msg

HISTORY = 8  # steps whose batch replies and grammar outputs may name
_NO_FIX = NewFix(0)
Media = tuple[list[Any], list[Any], Any]  # item data, placeholder masks, prompt embeds
Params = tuple[Any, Any, Any, int]  # sampling, pooling, LoRA request, replay start
_NO_MEDIA: Media = ([], [], None)  # (read only)


@dataclass(slots=True)
class _Lists:
    """A step's extension lists, read and checked against the step before its state
    changes (:meth:`SchedulerOutputDecoder._read`)."""

    new_pos: list[int]  # schedule position of each added handle
    cpos: list[int] | range | None  # the cached requests' positions (None: the batch
    # in order; a range: its first rows in order)
    new_tokens: list[list[int]]
    all_tokens: dict[int, list[int]]  # index among the cached requests -> history
    prefill: list[list[int] | None]  # per added request
    restored: dict[int, list[int]]  # added request -> tokens it sampled before a restart
    departures: tuple[Any, Any] | None
    copies: list[int] | None
    prefix: list[int]
    #: per added request, its parameters as vLLM objects, and its item data, placeholder
    #: masks and prompt embeds (store references resolved): made here, so a bad one
    #: refuses the step with the state unchanged
    params: list[Params]
    media: list[Media] | None


def _keyed(rows: RowSet, batch: list[str], shift: int = 0) -> dict[str, list[int]]:
    """A per-request dict from rows keyed by batch position (in the rows' order)."""
    values = [v - shift for v in rows.values] if shift else rows.values
    at = 0
    out = {}
    for p, c in zip(rows.keys, rows.counts, strict=True):
        out[batch[p]] = values[at:at + c]
        at += c
    return out


class SchedulerOutputDecoder:
    """Stateful frames → SchedulerOutput (see the module docstring).

    ``copy``: give multimodal tensors and prompt embeds their own writable memory.
    """

    def __init__(self, secret: bytes | None = None, copy: bool = False) -> None:
        self.seals = ChannelSeals(secret, b"reply", b"step")
        self.items: StoreResolver | None = None
        self.copy = copy
        self.state: ReplicaState | None = None
        self.seq = 0
        self.outputs = OutputCounts()
        self.names: list[str] = []  # request id by handle ("": none)
        self.batches: dict[int, list[str]] = {}
        self._sampling = SamplingMaker()
        self._batch: list[str] = []  # the last step's batch and its count map
        self._nst: dict[str, int] = {}
        self._nsched: Any = None
        self._total = 0  # the sum of _nsched
        self._grammar = GrammarDecoder()
        self._vllm = _vllm_classes()
        self._aux: list[Any] = []
        #: the last step's new requests that resume after a restart: id -> sampled tokens
        self.restored: dict[str, list[int]] = {}
        self._reply_enc = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(self._aux))

    def attach_store(self, reader: ShmReader) -> None:
        """Resolve multimodal items and prompt embeds from the engine's shared-memory
        store through ``reader`` from the next step on (a local channel)."""
        self.items = StoreResolver(reader)

    # ------------------------------------------------------------ execute_model
    def decode(self, frames: list[Any]) -> Any:
        msg = codec.decode(frames, copy=True)
        if type(msg) is not Delta:
            raise MalformedMessage("expected a Delta", got=type(msg).__name__)
        if msg.seq != self.seq + 1:
            raise InvalidDelta("step out of order", expected=self.seq + 1, got=msg.seq)
        ext = decode_ext(msg.body.extension)
        opener = self.seals.opener
        opened = opener.counter if opener is not None else 0
        opaque = self.seals.open(ext.sealed) if ext.sealed else None  # before any change
        if self.state is None and not 0 <= ext.kv_groups <= 64:
            raise MalformedMessage("KV groups out of range", kv_groups=ext.kv_groups)
        state = self.state or ReplicaState(kv_groups=ext.kv_groups or 1, keep_tables=False)
        read: list[_Lists] = []
        try:
            applied = state.apply(msg.body, expected_digest=msg.digest, before_commit=lambda
                                  a, schedule: read.append(self._read(ext, a, schedule, state)))
        except BaseException:
            if opener is not None:  # a refused step leaves its seal unused (resent: opens)
                opener.counter = opened
            if self.items is not None:
                self.items.abandon()
            raise
        self.state = state
        self.seq = msg.seq
        if self.items is not None:
            self.items.commit()
        return self._output(msg, ext, applied, opaque, read[0])

    # ------------------------------------------------------------ sample_tokens
    def decode_grammar(self, frames: list[Any]) -> Any:
        """The GrammarOutput sent with the step just decoded (one empty frame: None)."""
        if len(frames) == 1 and not len(frames[0]):
            return None
        return self._grammar.decode(frames, self.batches)

    # ------------------------------------------------------------ replies
    def encode_reply(self, out: Any) -> list[Frame]:
        """Frames of a ModelRunnerOutput (or None) answering the newest decoded step."""
        msg = ReplyMsg(seq=self.seq, none=True) if out is None else \
            reply_msg(out, self.batches.get(self.seq, []), self.seq, self.seals)
        self._aux.clear()
        try:
            return [self._reply_enc.encode(msg), *self._aux]
        finally:
            self._aux.clear()

    def _batch_of(self, applied: Applied) -> list[str]:
        """The step's batch (ids in schedule order): the last one's when it repeats, edited
        when the body dropped and appended, else made afresh."""
        names = self.names
        for h, spec in zip(applied.added, applied.specs, strict=True):
            if h >= len(names):
                names.extend([""] * (h + 1 - len(names)))
            names[h] = spec.req_id
        if not applied.schedule_changed:
            if not applied.added:
                return self._batch
            return list(map(names.__getitem__, self.state.schedule.tolist()))  # type: ignore[union-attr]
        if not applied.dropped and not applied.appended:  # a whole new schedule
            return list(map(names.__getitem__, self.state.schedule.tolist()))  # type: ignore[union-attr]
        batch = list(self._batch)
        for p in sorted(applied.dropped, reverse=True):
            del batch[p]
        batch += map(names.__getitem__, applied.appended)
        return batch

    def _count_map(self, batch: list[str], applied: Applied, nsched: Any) -> dict[str, int]:
        """The step's num_scheduled_tokens in batch order (the decoder's own dict: the
        caller copies it): the last one's, its dropped ids deleted, appended ones added
        and changed counts rewritten, when the schedule kept its order; else made afresh."""
        prev = self._nsched
        if prev is None or (applied.schedule_changed and not (applied.dropped
                                                              or applied.appended)) \
                or (not applied.schedule_changed and batch is not self._batch):
            return dict(zip(batch, nsched.tolist(), strict=True))
        if nsched is prev:
            return self._nst
        nst = dict(self._nst)
        old = self._batch
        for p in applied.dropped:
            del nst[old[p]]
        kept = len(batch) - len(applied.appended)
        # a kept position's count changed only where the body sent its count (nt) or the
        # request was re-added in place (predicted 1); the appended ones are new
        changed = [p for p in applied.recounted if p < kept]
        if applied.added:
            pos = self.state.cols.pos  # type: ignore[union-attr]
            changed += [int(pos[h]) for h in applied.added if 0 <= pos[h] < kept]
        for p in changed:
            nst[batch[p]] = int(nsched[p])
        if kept < len(batch):
            nst.update(zip(batch[kept:], nsched[kept:].tolist(), strict=True))
        return nst

    def _read(self, ext: StepExt, applied: Applied, schedule: I64,
              state: ReplicaState) -> _Lists:
        """The extension lists of the step ``applied`` that leads to ``schedule``, checked
        (MalformedMessage) while ``state`` is still the last step's."""
        n, added = schedule.size, applied.added
        new_pos: list[int] = []
        if applied is STEADY and not ext.cached_order:  # the batch again, in order
            cpos = None
        else:
            k = len(added)
            if added and applied.appended[len(applied.appended) - k:] == added:
                new_pos = list(range(n - k, n))  # (the common shape: appended last)
            elif added:
                inv = np.full(max(int(schedule.max()) if n else 0, max(added)) + 1, -1,
                              dtype=np.int64)
                inv[schedule] = np.arange(n)
                new_pos = inv[added].tolist()
                if min(new_pos) < 0:
                    raise MalformedMessage("an added request is not scheduled")
            cpos = self._cached_positions(n, new_pos, schedule, applied.resumed, ext)
        ncached = n if cpos is None else len(cpos)
        histories: dict[int, list[int]] = {}
        if ext.all_keys or ext.all_tokens:
            if not ext.all_keys:
                raise MalformedMessage("token histories without their keys")
            keys = unpack_uint_list(ext.all_keys, limit=max(ncached, 1))
            if len(keys) != len(ext.all_tokens) or (keys and max(keys) >= ncached):
                raise MalformedMessage("token histories do not match their keys")
            for k, ref in zip(keys, ext.all_tokens, strict=True):
                h = int(schedule[k if cpos is None else cpos[k]])
                histories[k] = resolve_ref(ref, _prompt(state.specs[h]))
        prefill = [None if k >= len(ext.prefill) or ext.prefill[k] is None
                   else resolve_ref(ext.prefill[k], applied.prompts[k])  # type: ignore[arg-type]
                   for k in range(len(added))]
        restored: dict[int, list[int]] = {}
        for k, raw in ext.restored:
            if not 0 <= k < len(added) or k in restored:
                raise MalformedMessage("restored tokens name no new request", index=k)
            restored[k] = unpack_sint_list(raw)
        copies = None
        if ext.block_copies is not None:
            copies = unpack_uint_list(ext.block_copies) if ext.block_copies else []
            if len(copies) % 2:
                raise MalformedMessage("block copies are not (source, destination) pairs")
        fixes = {f.i: f for f in reversed(ext.fixes)} if ext.fixes else {}  # (the first)
        params = [self._params(spec, fixes.get(k, _NO_FIX))
                  for k, spec in enumerate(applied.specs)]
        news = () if applied.body is None else applied.body.added if self.items is None \
            else self.items.resolve(state, applied, schedule)  # (a local channel's store)
        media = [self._media(r) for r in news] if any(
            r.mm_data or r.mm_embed or r.embeds is not None for r in news) else None
        return _Lists(new_pos, cpos, _new_tokens(ext), histories, prefill, restored,
                      OutputCounts.read(ext.out_pos, ext.out_delta, ncached), copies,
                      unpack_uint_list(ext.prefix_blocks) if ext.prefix_blocks else [],
                      params, media)

    def _output(self, msg: Delta, ext: StepExt, applied: Applied,
                opaque: dict[str, Any] | None, read: _Lists) -> Any:
        SchedulerOutput, CachedRequestData, ScheduledEncoderInputStats = self._vllm
        state = self.state
        assert state is not None  # noqa: S101 - made by decode
        body, rare = msg.body, msg.body.rare
        sched, cols, nsched = state.schedule, state.cols, state.nsched
        new_blocks: list[Any]
        cpos, new_pos = read.cpos, read.new_pos
        if applied is STEADY and not ext.cached_order:  # the batch again, in order
            batch, new_reqs, resumed = self._batch, [], set()
            cids, new_blocks = list(batch), [None] * len(batch)
        else:
            batch = self._batch_of(applied)
            resumed = {self.names[h] for h in applied.resumed}
            cids = list(batch) if cpos is None else batch[:len(cpos)] \
                if type(cpos) is range else [batch[p] for p in cpos]
            tables = self._tables(applied) if applied.blocks or applied.replaced else {}
            new_blocks = [None] * len(cids)
            if tables:  # each row's index among the cached requests (-1: a new one's)
                if cpos is None:
                    at = list(tables)
                elif type(cpos) is range:
                    at = [p if p < len(cpos) else -1 for p in tables]
                else:
                    inv = np.full(len(batch), -1, dtype=np.int64)
                    inv[cpos] = np.arange(len(cpos))
                    at = inv[list(tables)].tolist()
                for k, lists in zip(at, tables.values(), strict=True):
                    if k >= 0:
                        new_blocks[k] = tuple(lists)
            new_reqs = [self._new_request(h, p, applied.prompts[k], tables, read.prefill[k],
                                          read.params[k], read.media[k] if read.media else None)
                        for k, (h, p) in enumerate(zip(applied.added, new_pos, strict=True))]
            for h, spec, prompt in zip(applied.added, applied.specs,
                                       applied.prompts, strict=True):
                self.outputs.add(h, len(prompt) if prompt is not None else
                                 spec.embeds[1][0] if spec.embeds and spec.embeds[1] else 0)
        chandles = sched if cpos is None else sched[:len(cpos)] if type(cpos) is range \
            else sched[cpos]
        ccomp = cols.computed[chandles]
        outputs = self.outputs.apply(chandles, ccomp, read.departures)
        nst = self._count_map(batch, applied, nsched)
        if nsched is not self._nsched:
            self._total = int(nsched.sum())
        self._batch, self._nst, self._nsched = batch, nst, nsched
        preempted = None if ext.preempted_none else {self.names[h] for h in applied.preempted}
        stats = ext.enc_stats
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=cids, resumed_req_ids=resumed,
                new_token_ids=read.new_tokens,
                all_token_ids={cids[k]: tokens for k, tokens in read.all_tokens.items()},
                new_block_ids=new_blocks, num_computed_tokens=ccomp.tolist(),
                num_output_tokens=outputs.tolist()),
            num_scheduled_tokens=dict(nst),
            total_num_scheduled_tokens=ext.total if ext.total >= 0 else self._total,
            scheduled_spec_decode_tokens={} if applied.spec_rows is None
            else _keyed(applied.spec_rows, batch, 1),
            scheduled_encoder_inputs={} if applied.encoder_rows is None
            else _keyed(applied.encoder_rows, batch),
            finished_req_ids=set(applied.finished_ids),
            free_encoder_mm_hashes=list(rare.free_encoder_mm_hashes),
            scheduled_encoder_input_stats=None if stats is None
            else ScheduledEncoderInputStats(*stats),
            preempted_req_ids=preempted,
            has_structured_output_requests=body.has_structured_output,
            pending_structured_output_tokens=body.pending_structured_output,
            num_invalid_spec_tokens=None if ext.invalid_spec is None else dict(ext.invalid_spec),
            has_sync_kv_loads=ext.sync_kv,
            new_block_ids_to_zero=applied.zero,
            kv_cache_block_copies=None if read.copies is None else _copies(read.copies),
            num_spec_tokens_to_schedule=rare.num_spec_tokens_to_schedule,
            num_common_prefix_blocks=read.prefix)
        if opaque:
            for name, value in opaque.items():
                setattr(so, name, value)
        self.restored = {new_reqs[k].req_id: t for k, t in read.restored.items()} \
            if read.restored else {}
        self.batches[msg.seq] = batch
        self.batches.pop(msg.seq - HISTORY, None)
        return so

    def _tables(self, applied: Applied) -> dict[int, list[list[int]]]:
        """Per batch position named by the step's block rows, its ids per KV group
        (replaced ids, then appended ones)."""
        groups = self.state.kv_groups  # type: ignore[union-attr]
        out: dict[int, list[list[int]]] = {}
        rs = applied.blocks[0] if groups == 1 and applied.blocks else None
        if rs is not None and (not applied.replaced or applied.replaced[0] is None):
            at, values = 0, rs.values  # one group, appended rows alone: one list a row
            for p, c in zip(rs.keys, rs.counts, strict=True):
                out[p] = [values[at:at + c]]
                at += c
            return out
        for sets in (applied.replaced, applied.blocks):
            for g, rs in enumerate(sets):
                if rs is None:
                    continue
                at = 0
                for p, c in zip(rs.keys, rs.counts, strict=True):
                    lists = out.get(p)
                    if lists is None:
                        lists = out[p] = [[] for _ in range(groups)]
                    lists[g] += rs.values[at:at + c]
                    at += c
        return out

    @staticmethod
    def _cached_positions(n: int, new_pos: list[int], schedule: I64, resumed: list[int],
                          ext: StepExt) -> list[int] | range | None:
        """Batch positions of the cached requests in their list order (None: the whole
        batch in order, the steady step's shape; a range: the batch's first rows in
        order); ``resumed``: handles."""
        if ext.cached_order:
            cpos = unpack_uint_list(ext.cached_order, limit=n)
            if len(cpos) + len(new_pos) != n or set(cpos) & set(new_pos) \
                    or len(set(cpos)) != len(cpos) or (cpos and max(cpos) >= n):
                raise MalformedMessage("cached order does not fit the batch")
            return cpos
        if not new_pos and not resumed:
            return None
        m = n - len(new_pos)
        if not resumed and new_pos == list(range(m, n)):
            return range(m)  # (the common shape: the new requests last)
        new = set(new_pos)
        rest = [p for p in range(n) if p not in new]
        if resumed:
            back = set(resumed)
            hs = schedule.tolist()
            rest = [p for p in rest if hs[p] not in back] + [p for p in rest if hs[p] in back]
        return rest

    def _new_request(self, h: int, p: int, prompt: list[int] | None,
                     tables: dict[int, list[list[int]]], prefill: list[int] | None,
                     params: Params, media: Media | None) -> Any:
        from vllm.v1.core.sched.output import NewRequestData

        state = self.state
        assert state is not None  # noqa: S101
        spec = state.specs[h]
        assert spec is not None  # noqa: S101 - added this step
        groups = state.kv_groups
        lists = tables.get(p)
        data, masks, embeds = media or _NO_MEDIA
        sampling, pooling, lora, replay_start = params
        return NewRequestData(
            req_id=spec.req_id, prompt_token_ids=prompt,
            mm_features=self._features(spec, data, masks) if spec.mm else [],
            sampling_params=sampling, pooling_params=pooling,
            block_ids=tuple(lists) if lists is not None else tuple([] for _ in range(groups)),
            num_computed_tokens=int(state.cols.computed[h]),
            lora_request=lora, prompt_embeds=embeds,
            prompt_is_token_ids=None if spec.prompt_is_token_ids is None
            else list(spec.prompt_is_token_ids),
            prefill_token_ids=prefill,
            replay_start=replay_start)

    def _params(self, spec: Spec, fix: NewFix) -> Params:
        """A new request's parameters as vLLM objects (MalformedMessage if they make none)."""
        return (None if spec.sampling is None
                else self._sampling.make(spec.sampling, fix.int_floats, fix.logprob_ids_dtype),
                spec_to_pooling(spec.pooling), spec_to_lora(spec.lora, fix.lora_3d),
                fix.replay_start)

    def _media(self, req: NewRequest) -> Media:
        """A new request's item data, placeholder masks and prompt embeds as vLLM objects,
        fresh (MalformedMessage for one that is not)."""
        copy = self.copy
        return ([item_from_wire(d, copy) for d in req.mm_data],
                [mask_from_wire(e, copy) for e in req.mm_embed],
                None if req.embeds is None else embeds_from_wire(req.embeds, copy))

    @staticmethod
    def _features(spec: Spec, data: list[Any], masks: list[Any]) -> list[Any]:
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

        n = len(spec.mm)
        return [MultiModalFeatureSpec(
            data=d, modality=m.modality, identifier=m.identifier,
            mm_position=PlaceholderRange(m.offset, m.length, e), mm_hash=m.mm_hash)
            for m, d, e in zip(spec.mm, data or [None] * n, masks or [None] * n, strict=True)]


def _vllm_classes() -> tuple[Any, Any, Any]:
    """(SchedulerOutput, CachedRequestData, ScheduledEncoderInputStats), imported once."""
    from vllm.v1.core.sched.output import (
        CachedRequestData,
        ScheduledEncoderInputStats,
        SchedulerOutput,
    )

    return SchedulerOutput, CachedRequestData, ScheduledEncoderInputStats


def _prompt(spec: Any) -> list[int] | None:
    return None if spec.prompt_none else unpack_uint_list(spec.prompt)


def _new_tokens(ext: StepExt) -> list[list[int]]:
    if ext.new_tokens is None:
        return []
    counts = unpack_uint_list(ext.new_tokens[0])
    flat = unpack_sint_list(ext.new_tokens[1])
    if sum(counts) != len(flat):
        raise MalformedMessage("new tokens do not add up", counts=len(counts))
    at = [0, *accumulate(counts)]
    return [flat[at[i]:at[i + 1]] for i in range(len(counts))]


def _copies(flat: list[int]) -> Any:
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    return [KVCacheBlockCopy(flat[k], flat[k + 1]) for k in range(0, len(flat), 2)]

