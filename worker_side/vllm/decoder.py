"""Worker side: frames → vLLM ``SchedulerOutput``, and ``ModelRunnerOutput`` → reply frames.

The decoder applies each Delta to its :class:`ReplicaState`, rebuilds the
step's :class:`ExecuteModelRequest`, and converts it -- with its memory of
previous steps and the departures in ``extension["v"]`` -- into a
SchedulerOutput equal to the engine's.  Every call returns fresh objects: the
runner keeps and extends ``block_ids`` lists, ``CachedRequestData`` caches a
property, and ``mm_features`` are rewritten in place.

Raises: MalformedMessage for frames that do not decode, InvalidDelta for a step
out of order or that does not apply, BadSeal for connector metadata whose MAC
does not verify; in all three cases before anything changed (nothing unpickled).
What only the output's assembly finds -- extension lists that do not fit the step
(MalformedMessage), a token reference beyond what this worker holds
(RemoteProtocolError) -- is raised after the replica applied the step (its digest
matched): the decoder is then out of step with the engine, and the rank reports the
exception to the engine as it reports any (``worker_side/vllm/proc.py``).
"""

from __future__ import annotations

from itertools import accumulate, compress, filterfalse, repeat
from operator import not_
from typing import Any

import msgspec
import numpy as np

from engine_side.vllm.convert import (
    REPLY_LABEL,
    STEP_LABEL,
    ChannelSeals,
    StepMemory,
    TokenLedger,
    cached_order,
    resolve_ref,
    split_rows,
)
from engine_side.vllm.params import SamplingMaker, spec_to_lora, spec_to_pooling
from engine_side.vllm.schema import (
    NewFix,
    ReplyMsg,
    StepExt,
)
from protocol import codec
from protocol.codec import Frame
from protocol.errors import InvalidDelta, MalformedMessage
from protocol.lane import SteadyLane
from protocol.lane_lists import NO_ROWS
from protocol.messages import TOKEN_MODE_WORKER, Delta, DeltaBody, Rows
from protocol.packing import unpack_sints, unpack_uints
from protocol.plan import STEADY_BODY
from protocol.planned import FLAG_BODIES
from protocol.request import ExecuteModelRequest, IntArray, Ragged
from protocol.speedups import C as _C
from protocol.state import ReplicaState
from protocol.tensors import make_enc_hook
from worker_side.shm_reader import ShmReader
from worker_side.vllm.finish import finish_output
from worker_side.vllm.grammar import GrammarDecoder
from worker_side.vllm.mm import StoreResolver, features_from_refs, fresh
from worker_side.vllm.quick import QuickDecoder, decode_ext, made, plain
from worker_side.vllm.replies import reply_msg
from worker_side.vllm.turnover import turnover_output, turnover_shaped

#: what wire lists that do not fit the step raise while its SchedulerOutput is made
_SHAPE_ERRORS = (ValueError, IndexError, KeyError, TypeError)
HISTORY = 8
_NO_FIX = NewFix(0)  # a new request without exactness fixes (only its fields are read)


def _ints(packed: bytes) -> list[int]:
    return unpack_uints(packed).tolist() if packed else []


def _keyed(r: Ragged, batch: list[str], keys: bytes | None, shift: int = 0,
           ) -> dict[str, list[int]]:
    """A per-request dict from aligned rows: non-empty rows in batch order unless ``keys``."""
    if keys is None and not r.values.size:
        return {}
    vals = (r.values - shift).tolist() if shift else r.values.tolist()
    lengths = r.lengths.tolist()
    if keys is None and len(lengths) == len(batch):  # one C call (the usual drafts)
        return split_rows(batch, lengths, vals)
    off = [0, *accumulate(lengths)]
    positions = [i for i in range(len(batch)) if off[i + 1] > off[i]] if keys is None \
        else _ints(keys)
    return {batch[i]: vals[off[i]:off[i + 1]] for i in positions}


class _Tables:
    """One step's block tables (one Ragged per KV group); rows materialised on demand."""

    def __init__(self, tables: tuple[Ragged, ...]) -> None:
        self.lengths_np = [t.lengths for t in tables]
        self.lengths = [t.lengths.tolist() for t in tables]
        self.offsets = [[0, *accumulate(n)] for n in self.lengths]
        self.values = [t.values for t in tables]

    def row(self, g: int, i: int, skip: int = 0) -> list[int]:
        lo, hi = self.offsets[g][i] + skip, self.offsets[g][i + 1]
        return self.values[g][lo:hi].tolist() if hi > lo else []


class SchedulerOutputDecoder:
    """Stateful frames → SchedulerOutput (see the module docstring).

    ``reader``: this worker's store reader when the engine's encoder has a store
    (a local channel); ``copy``: give multimodal tensors and prompt embeds their
    own writable memory (buffer rule: ``worker_side.vllm.mm``); ``fast=False``:
    every step takes the general path (tests compare the two); ``seals``: the seals of
    the decoder this one replaces (their counters go on), else new ones of ``secret``.
    """

    def __init__(self, secret: bytes | None = None, ledger: TokenLedger | None = None,
                 reader: ShmReader | None = None, copy: bool = False,
                 fast: bool = True, seals: ChannelSeals | None = None) -> None:
        self.secret = secret
        self.seals = seals or ChannelSeals(secret, sends=REPLY_LABEL, receives=STEP_LABEL)
        self.items = None if reader is None else StoreResolver(reader)
        self.copy = copy
        self.fast = fast
        self.quick = QuickDecoder()
        self.quick_steps = 0  # steps answered by the same-batch fast path
        self.turnover_steps = 0  # general steps answered by the turnover fast path
        self.finish_steps = 0  # of the same-batch steps, those where requests finished
        self.state: ReplicaState | None = None
        self.lane = SteadyLane(ReplicaState())  # replaced with the state's own lane
        self.seq = 0
        self.mem = StepMemory(ledger)
        self._sampling = SamplingMaker()
        self.batches: dict[int, list[str]] = {}
        self._last_batch: list[str] = []
        self._last_lengths: list[IntArray] = []
        self._lengths_stale = False  # blocks appended since (see _refresh_lengths)
        self._aux: list[Any] = []
        self._reply_enc = msgspec.msgpack.Encoder(enc_hook=make_enc_hook(self._aux))
        self._grammar = GrammarDecoder()

    # ------------------------------------------------------------ execute_model
    def decode(self, frames: list[Any]) -> Any:
        quick = self.quick
        if quick.ready and self.fast and len(frames) == 1:
            counted = _C.lane_view(frames[0]) if _C is not None else None
            # a same-batch step with count or draft rows, read as one and answered by
            # another C call (QuickDecoder.counted_view), no message objects made; out of
            # order or not taken: the general lines below decide (and raise)
            if counted is not None and counted[1] == self.seq + 1 and self.state is not None:
                so = quick.counted_view(self.lane, counted, frames[0])
                if so is not None:
                    self._quick_step(counted[1], bool(counted[6]))
                    return so
            view = codec.decode_plain(frames[0])  # a plain step, read as one
            if view is not None and view.seq == self.seq + 1:
                body = view.body
                flags = FLAG_BODIES[body.has_structured_output, body.pending_structured_output]
                so = self._plain_step(view.seq, view.digest, body.block_append, flags, quick)
                if so is not None:
                    return so
        msg = codec.decode(frames, copy=True)
        if not isinstance(msg, Delta):
            raise MalformedMessage("expected a Delta", got=type(msg).__name__)
        if msg.seq != self.seq + 1:
            raise InvalidDelta("step out of order", expected=self.seq + 1, got=msg.seq)
        body = msg.body
        # count or draft rows are never plain: their bodies skip the ~20-field test
        if quick.ready and self.fast and body.computed_tokens is None \
                and body.spec_tokens is None and (body == STEADY_BODY or plain(body)):
            so = self._plain_step(msg.seq, msg.digest, body.block_append, body, quick)
            if so is not None:
                return so
        ext = decode_ext(body.extension.get("v"))
        opaque = self.seals.open(ext.sealed)  # before anything changes
        if self.state is None:
            self.state = ReplicaState(TOKEN_MODE_WORKER, ext.kv_groups or 1)
            self.lane = SteadyLane(self.state)
        if self.fast and body.finished and body.schedule_drop:
            so = finish_output(self, msg, ext)  # the last batch less finished requests
            if so is not None:
                return so
        counted = quick.counted_step(self.lane, body, ext, msg.digest) \
            if self.fast and quick.ready else None
        if counted is not None:  # a same-batch step with count rows, in one call
            self._quick_step(msg.seq, bool(body.block_append))
            return counted
        fast = quick.lane_inputs(body, ext) if self.fast and quick.ready else None
        turnover = fast is None and self.fast and turnover_shaped(self, body, ext)
        if fast is None or self.lane.step(body, fast[0], msg.digest, fast[1]) is None:
            self.lane.settle()
            if fast is None and self._lengths_stale:
                self._refresh_lengths()
            self.state.apply(msg.body, expected_digest=msg.digest)
        try:
            return self._output(msg, ext, opaque, fast, turnover)
        except _SHAPE_ERRORS as exc:  # wire lists that do not fit the step's requests
            raise MalformedMessage("vLLM step extension does not fit its step",
                                   cause=f"{type(exc).__name__}: {str(exc)[:200]}") from exc

    def _output(self, msg: Delta, ext: StepExt, opaque: dict[str, Any], fast: Any,
                turnover: bool) -> Any:
        """The SchedulerOutput of step ``msg``, applied to the replica (``fast``: the lane
        took it with these inputs; ``turnover``: it has the turnover's shape)."""
        assert self.state is not None  # noqa: S101 - made by decode
        if fast is not None:
            self._quick_step(msg.seq, bool(msg.body.block_append))
            return self.quick.scheduler_output(msg.body, ext, *fast)
        self.seq = msg.seq
        self.batches.pop(msg.seq - HISTORY, None)
        if turnover:
            so = turnover_output(self, msg.body, ext)
            if so is not None:
                self.turnover_steps += 1
                return so
        # A plain body adds, finishes and frees nothing: the store resolver has
        # nothing to do on the fast path above.
        request = self.state.rebuild()
        if self.items is not None:
            request = self.items.resolve(request)
        so = self._scheduler_output(request, ext, opaque)
        self.after_general(request.req_ids, request.num_computed_tokens.tolist(),
                           so.num_scheduled_tokens)
        return so

    def _quick_step(self, seq: int, appended: bool) -> None:
        """Step ``seq`` was answered by the same-batch path (``appended``: its body
        appended blocks, so the last batch's table lengths are stale)."""
        self.seq = seq
        self.batches.pop(seq - HISTORY, None)
        self.batches[seq] = self.quick.batch
        self._lengths_stale |= appended
        self.quick_steps += 1

    def after_general(self, batch: list[str], computed: list[int],
                      nsched: dict[str, int]) -> None:
        """After a general step (its batch and actual counts): replies may name the
        batch, the lane opens on the new schedule, the quick decoder predicts from it."""
        assert self.state is not None  # noqa: S101 - a step was applied
        self.batches[self.seq] = batch
        self.lane.open(computed)  # here, not in the next same-batch step
        self.quick.reset(batch, self.lane.handles, computed, nsched,
                         list(map(self.mem.plen.__getitem__, batch)), self.state.kv_groups)

    def _plain_step(self, seq: int, digest: int, appends: tuple[Rows, ...], body: DeltaBody,
                    quick: QuickDecoder) -> Any:
        """The SchedulerOutput of step ``seq`` when it is the forecast step but for the block
        appends ``appends`` (the step's block_append) and the structured-output flags of
        ``body`` (a :func:`plain` body), answered without the extension, the count rows or
        the general checks (the lane still checks the appends and the digest); None,
        nothing changed, when the lane does not take the appends."""
        new_blocks = None
        if not appends:
            self.lane.steady(digest, body)
            blocks = None
        else:
            got = quick.plain_blocks(appends)
            if got is None:
                return None
            blocks, new_blocks = got
            lane = self.lane
            if (len(blocks) != 1 or lane.appended(blocks[0], digest, body) is None) \
                    and lane.step(body, blocks, digest, NO_ROWS) is None:
                return None
        self._quick_step(seq, blocks is not None)
        return quick.steady_output(blocks, body, new_blocks)

    def _refresh_lengths(self) -> None:
        """The last batch's table lengths after same-batch steps appended blocks (read
        from the settled replica, which holds exactly vLLM's tables): the quick path
        leaves them stale instead of updating them every step."""
        assert self.state is not None  # noqa: S101 - a step was decoded before
        sched, batch = self.state.schedule, self._last_batch
        self._last_lengths = [table.lengths[sched] for table in self.state.blocks]
        for lens, now in zip(self.mem.table_len, self._last_lengths, strict=True):
            lens.update(zip(batch, now.tolist(), strict=True))
        self._lengths_stale = False

    def _scheduler_output(self, r: ExecuteModelRequest, x: StepExt, opaque: dict[str, Any],
                          ) -> Any:
        mem, batch = self.mem, r.req_ids
        mem.finish(r.finished_req_ids)
        is_new = list(map(not_, map(mem.known.__contains__, batch)))
        for i in _ints(x.new_flip):
            is_new[i] = not is_new[i]
        tables = _Tables(r.block_tables)
        rows = range(len(batch))
        new_reqs = self.new_requests(r, x, list(compress(rows, is_new)), tables)
        cached = self._cached(r, x, list(compress(rows, map(not_, is_new))), tables)
        so = self.assemble(batch, r.num_scheduled_tokens.tolist(), new_reqs, cached, r, x,
                           opaque)
        if not mem.table_len:
            mem.table_len = [{} for _ in tables.lengths]
        for lens, now in zip(mem.table_len, tables.lengths, strict=True):
            lens.update(zip(batch, now, strict=True))
        self.set_last_lengths(batch, tables.lengths_np)
        return so

    def set_last_lengths(self, batch: list[str], lengths: list[IntArray]) -> None:
        """The batch whose table lengths (per KV group) the next step's new blocks
        are measured from."""
        self._last_batch, self._last_lengths = batch, lengths

    def assemble(self, batch: list[str], nsched_list: list[int], new_reqs: list[Any],
                 cached: Any, r: Any, x: StepExt, opaque: dict[str, Any]) -> Any:
        """The SchedulerOutput of a general step from its new and cached request data,
        the step fields of ``r`` (a rebuilt request) and the extension; the decoder
        remembers the batch as scheduled."""
        from vllm.v1.core.sched.output import ScheduledEncoderInputStats, SchedulerOutput

        mem = self.mem
        zero = None if r.blocks_to_zero is None else r.blocks_to_zero.tolist()
        nsched = dict(zip(batch, nsched_list, strict=True))
        so = SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached,
            num_scheduled_tokens=nsched,
            total_num_scheduled_tokens=x.total if x.total >= 0 else sum(nsched.values()),
            scheduled_spec_decode_tokens=_keyed(r.spec_token_ids, batch, x.spec_keys, 1),
            scheduled_encoder_inputs=_keyed(r.encoder_inputs, batch, x.enc_keys),
            finished_req_ids=set(r.finished_req_ids),
            free_encoder_mm_hashes=list(r.free_encoder_mm_hashes),
            scheduled_encoder_input_stats=None if x.enc_stats is None
            else ScheduledEncoderInputStats(*x.enc_stats),
            preempted_req_ids=None if x.preempted_none else set(r.preempted_req_ids),
            has_structured_output_requests=r.has_structured_output_requests,
            pending_structured_output_tokens=r.pending_structured_output_tokens,
            num_invalid_spec_tokens=None if x.invalid_spec is None else dict(x.invalid_spec),
            has_sync_kv_loads=x.sync_kv,
            new_block_ids_to_zero=[] if x.zero_empty else zero,
            kv_cache_block_copies=self._copies(x.block_copies),
            num_spec_tokens_to_schedule=r.num_spec_tokens_to_schedule,
            num_common_prefix_blocks=_ints(x.prefix_blocks) if x.prefix_blocks else [])
        for name, value in opaque.items():
            setattr(so, name, value)
        mem.known.update(batch)
        mem.prev_batch = set(batch)
        return so

    @staticmethod
    def _copies(packed: bytes | None) -> Any:
        if packed is None:
            return None
        from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

        flat = _ints(packed)
        return [KVCacheBlockCopy(flat[k], flat[k + 1]) for k in range(0, len(flat), 2)]

    def new_requests(self, r: ExecuteModelRequest, x: StepExt, positions: list[int],
                     tables: _Tables) -> list[Any]:
        """The NewRequestData of the rows at ``positions`` (their whole tables from
        ``tables``; ``r`` supplies specs and computed counts by position)."""
        from vllm.v1.core.sched.output import NewRequestData

        if x.new_order:
            order = _ints(x.new_order)
            actual = [0] * len(positions)
            for j, k in enumerate(order):
                actual[k] = positions[j]
            positions = actual
        fixes = {f.i: f for f in x.fixes}
        computed = r.num_computed_tokens
        groups = range(len(tables.values))
        out = []
        for k, i in enumerate(positions):
            spec, fix = r.specs[i], fixes.get(k, _NO_FIX)
            prompt = spec.prompt_token_ids
            self.mem.remember(spec)
            ref = x.prefill[k] if x.prefill else None
            self.mem.mrv2 |= ref is not None
            # (made as pickle makes it: the dataclass has no __post_init__; every field)
            out.append(made(NewRequestData, {
                "req_id": spec.req_id,
                "prompt_token_ids": None if prompt is None else prompt.tolist(),
                "mm_features": features_from_refs(spec.mm_features, self.copy)
                if spec.mm_features else [],
                "sampling_params": None if spec.sampling is None
                else self._sampling.make(spec.sampling, fix.int_floats, fix.logprob_ids_dtype),
                "pooling_params": spec_to_pooling(spec.pooling),
                "block_ids": (tables.row(0, i),) if len(groups) == 1
                else tuple(tables.row(g, i) for g in groups),
                "num_computed_tokens": int(computed[i]),
                "lora_request": spec_to_lora(spec.lora, fix.lora_3d),
                "prompt_embeds": None if spec.prompt_embeds is None
                else fresh(spec.prompt_embeds, self.copy),
                "prompt_is_token_ids": None if spec.prompt_is_token_ids is None
                else list(spec.prompt_is_token_ids),
                "prefill_token_ids": None if ref is None
                else resolve_ref(ref, prompt, self.mem.held(spec.req_id)),
                "replay_start": fix.replay_start}))
        return out

    def _cached(self, r: ExecuteModelRequest, x: StepExt, positions: list[int],
                tables: _Tables) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData

        batch, resumed = r.req_ids, set(r.resumed_req_ids)
        positions = _ints(x.cached_order) if x.cached_order else \
            cached_order(positions, batch, resumed)
        ids = list(map(batch.__getitem__, positions))
        at = np.array(positions, dtype=np.int64)
        comp = r.num_computed_tokens[at]
        outputs = self.mem.predicted_outputs(ids, comp)
        if x.out_pos:
            outputs[unpack_uints(x.out_pos)] += unpack_sints(x.out_delta)
        return CachedRequestData(
            req_ids=ids, resumed_req_ids=resumed, new_token_ids=self._new_tokens(x),
            all_token_ids=self._all_tokens(x, ids),
            new_block_ids=self._new_blocks(ids, positions, at, resumed, tables, x),
            num_computed_tokens=comp.tolist(), num_output_tokens=outputs.tolist())

    def _new_blocks(self, ids: list[str], positions: list[int], at: IntArray, resumed: set[str],
                    tables: _Tables, x: StepExt) -> list[tuple[list[int], ...] | None]:
        """Each cached request's blocks past what it had (all of them when resumed)."""
        n = len(ids)
        flips = set(_ints(x.none_flip))
        if ids == self._last_batch:  # steady decode: last step's lengths, same order
            prev = [lens.copy() for lens in self._last_lengths]
        else:
            prev = [np.fromiter(map(lens.get, ids, repeat(0, n)), np.int64, n)
                    for lens in self.mem.table_len]
        if resumed:
            mask = np.fromiter(map(resumed.__contains__, ids), bool, n)
            for p in prev:
                p[mask] = 0
        grown = np.zeros(n, dtype=bool)
        for g, p in enumerate(prev):
            grown |= tables.lengths_np[g][at] > p
        out: list[tuple[list[int], ...] | None] = [None] * n
        for k in sorted(set(np.flatnonzero(grown).tolist()) | flips):
            rows = tuple(tables.row(g, positions[k], int(p[k])) for g, p in enumerate(prev))
            out[k] = None if (not any(rows)) != (k in flips) else rows
        return out

    @staticmethod
    def _new_tokens(x: StepExt) -> list[list[int]]:
        if x.new_tokens is None:
            return []
        counts = _ints(x.new_tokens[0])
        flat = unpack_sints(x.new_tokens[1]).tolist()
        off = np.cumsum([0, *counts]).tolist()
        return [flat[off[i]:off[i + 1]] for i in range(len(counts))]

    def _all_tokens(self, x: StepExt, ids: list[str]) -> dict[str, list[int]]:
        mem = self.mem
        if x.all_keys is not None:
            keys = [ids[k] for k in _ints(x.all_keys)]
        else:
            keys = [] if mem.mrv2 else list(filterfalse(mem.prev_batch.__contains__, ids))
        return {rid: resolve_ref(ref, mem.prompt.get(rid), mem.held(rid))
                for rid, ref in zip(keys, x.all_tokens, strict=True)}

    # ------------------------------------------------------------ sample_tokens
    def decode_grammar(self, frames: list[Any]) -> Any:
        """The GrammarOutput sent with the step just decoded (None stays None)."""
        if len(frames) == 1 and not bytes(frames[0]):
            return None  # most steps: one empty frame
        return self._grammar.decode(frames, self.batches)

    # ------------------------------------------------------------ replies
    def encode_reply(self, out: Any) -> list[Frame]:
        """Frames of a ModelRunnerOutput (or None) answering the newest decoded step."""
        msg = ReplyMsg(seq=self.seq, none=True) if out is None else \
            reply_msg(out, self.batches.get(self.seq, []), self.seq, self.seals)
        if out is not None:
            self.mem.record_output(out)
        self._aux.clear()
        try:
            return [self._reply_enc.encode(msg), *self._aux]
        finally:
            self._aux.clear()
