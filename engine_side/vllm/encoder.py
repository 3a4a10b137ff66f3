"""Engine side: vLLM ``SchedulerOutput`` → frames (the replies back: :mod:`.replies`).

Theory of operation
-------------------
Each step the encoder turns the SchedulerOutput into our full
:class:`ExecuteModelRequest` (maintaining every live request's spec and whole
block table from ``NewRequestData.block_ids`` plus ``new_block_ids`` --
replaced for ``resumed_req_ids``), lets its :class:`EngineMirror` diff it, and
returns ``codec.encode(delta)``.  Everything the request has no column for
travels in ``extension["v"]`` (:class:`StepExt`) *as departures from what the
decoder predicts* from its own memory of previous steps (new vs cached, list
orders, ``num_output_tokens``, ``None`` vs empty ...), so a steady step adds
nothing.  Connector metadata travels sealed (HMAC-authenticated pickle).

Three fast paths build that very body without the whole request (their frames are
the general path's, byte for byte): the same-batch step (:mod:`.quick`), the finish
step, where requests of the last batch finish and the rest stay (:mod:`.finish`), and
the turnover step, where requests leave the batch and new ones join at its end
(:mod:`.turnover`).  Every other step takes the general path.

Draft tokens travel as ``token + 1`` so vLLM's ``-1`` placeholders pack as
unsigned integers.

Contract: ``encode`` reads the SchedulerOutput synchronously and keeps no
reference to it (the engine mutates it after dispatch).  Steps must reach the
decoder in order; the transport adds sequencing and resync.
"""

from __future__ import annotations

from itertools import compress, filterfalse, repeat
from operator import is_not, not_
from typing import Any

import msgspec
import numpy as np

from engine_side.diffing import BlockHint
from engine_side.mirror import EngineMirror
from engine_side.shm_store import ShmStore
from engine_side.vllm.convert import (
    REPLY_LABEL,
    STEP_LABEL,
    ChannelSeals,
    StepMemory,
    TokenLedger,
    cached_order,
    check_scheduled,
    make_ref,
)
from engine_side.vllm.finish import finish_delta
from engine_side.vllm.grammar import GrammarEncoder
from engine_side.vllm.mm import StoreChannel
from engine_side.vllm.params import SpecReader, new_request_spec
from engine_side.vllm.quick import Packed, QuickEncoder, Scan
from engine_side.vllm.rare import step_ext
from engine_side.vllm.replies import IndexCache, decode_reply
from engine_side.vllm.schema import (
    StepExt,
    TokenRef,
    check_schema,
)
from engine_side.vllm.tables import append_rows, keyed_rows, ragged, table_hint
from engine_side.vllm.turnover import turnover_delta
from protocol import codec
from protocol.codec import Frame
from protocol.errors import LocalProtocolError
from protocol.lane import SteadyLane
from protocol.lane_lists import NO_ROWS
from protocol.messages import Delta, DeltaBody, Rows
from protocol.packing import pack_sints, pack_uints
from protocol.plan import STEADY_BODY
from protocol.request import ExecuteModelRequest, IntArray, Ragged, RequestSpec
from protocol.speedups import C as _C

_EMPTY = np.zeros(0, dtype=np.int64)
HISTORY = 8  # steps whose batch order replies may still reference
#: noted steps of block appends filed into our tables at once, even before a general step
#: reads them: a long run of same-batch steps keeps at most this many (bounded memory)
UNFILED = 256


def _packed(values: list[int]) -> bytes:
    return pack_uints(values) if values else b""


def _not_none(values: list[Any]) -> list[int]:
    """Positions of the entries that are not None (C-level maps: no per-row bytecode)."""
    return list(compress(range(len(values)), map(is_not, values, repeat(None))))


class SchedulerOutputEncoder:
    """Stateful SchedulerOutput → frames (one Delta message per step).

    Args:
        kv_groups: KV-cache groups; None infers it from the first new request.
        secret: per-run HMAC key for connector metadata (None: refuse such metadata).
        ledger: tokens the workers hold (fed by :meth:`decode_reply`); enables
            references instead of resending history in prefill/all_token_ids.
        epoch: the mirror's epoch.
        store: the host's shared-memory store when every worker of this channel is
            attached to it: multimodal items and prompt embeds are then written
            once and sent by reference (``engine_side.vllm.mm``); None: inline frames.
    """

    def __init__(self, kv_groups: int | None = None, secret: bytes | None = None,
                 ledger: TokenLedger | None = None, epoch: int = 1,
                 verify: bool = False, store: ShmStore | None = None,
                 fast: bool = True) -> None:
        check_schema()
        self.kv_groups = kv_groups
        self.secret = secret
        self.seals = ChannelSeals(secret, sends=STEP_LABEL, receives=REPLY_LABEL)
        self.epoch = epoch
        self.verify = verify
        self.fast = fast  # False: every step takes the general path (tests compare the two)
        self.quick = QuickEncoder()
        self.quick_steps = 0  # steps encoded by the same-batch fast path
        self.turnover_steps = 0  # general steps encoded by the turnover fast path
        self.finish_steps = 0  # of the same-batch steps, those where requests finished
        self.mirror: EngineMirror | None = None
        self.lane: SteadyLane | None = None  # the mirror's steady steps (protocol.lane)
        self.items = None if store is None else StoreChannel(store)
        self.mem = StepMemory(ledger)
        self.spec_reader = SpecReader()  # (cached conversions of SamplingParams)
        self.specs: dict[str, RequestSpec] = {}
        self.tables: dict[str, list[list[int]]] = {}  # our own lists (extended in place)
        #: same-batch steps' appends not yet in ``tables``: (batch, per-group appends)
        self._unfiled: list[tuple[list[str], list[tuple[list[int], list[int], list[int]]]]] = []
        self.batches: dict[int, list[str]] = {}
        self._index = IndexCache()  # replies' req_id_to_index of the last batch
        self._last_batch: list[str] = []
        self._pos: dict[str, int] = {}
        self._last_blocks: tuple[Ragged, ...] | None = None
        #: how this step's tables differ from the mirror's, when they were carried
        self._hint: BlockHint | None = None
        self._grammar = GrammarEncoder()

    @property
    def seq(self) -> int:
        return 0 if self.mirror is None else self.mirror.seq

    # ------------------------------------------------------------ execute_model
    def encode(self, so: Any) -> list[Frame]:
        """Frames of one step (one Delta message).

        Raises LocalProtocolError for a stream vLLM cannot produce (a cached request
        never scheduled, ...); the encoder is then unusable: start a new epoch.
        """
        mirror, lane = self.mirror, self.lane
        if mirror is None or lane is None or lane.state is not mirror.state:
            mirror, lane = self._start(so)
        quick = self.quick
        # a step after one with drafts (speculative decoding) rarely is plain: skip the test
        plain = quick.plain_step(so) if self.fast and quick.rows.drafts is None else None
        if plain is not None:
            flags, packed = plain
            if packed is not None:
                return self._plain_appended(mirror, lane, flags, packed)
            if flags is not STEADY_BODY:  # nothing but structured-output flags
                return self._same_batch(mirror, lane, flags)
            delta = mirror.lane_delta(STEADY_BODY, lane.steady())  # the steady decode step
            self._quick_taken(delta.seq)
            return codec.encode(delta)
        if not self.fast:
            return self._general(mirror, lane, so)
        scan = quick.scan(so)  # a same-batch step that is not plain, read by C
        if scan is not None:
            frames = self._counted(mirror, lane, scan)
            if frames is not None:
                return frames
        body = quick.scanned_body(scan) if scan is not None else quick.body(so, scanned=True)
        if body is not None:
            return self._same_batch(mirror, lane, body)
        if so.finished_req_ids and not so.scheduled_new_reqs:
            frames = finish_delta(self, so)  # the last batch less finished requests
            if frames is not None:
                return frames
        frames = turnover_delta(self, so)
        return frames if frames is not None else self._general(mirror, lane, so)

    def _counted(self, mirror: EngineMirror, lane: SteadyLane, scan: Scan,
                 ) -> list[Frame] | None:
        """The frame of a same-batch step the C scan read (``scan``), the lane's step taken
        by one C call (:meth:`SteadyLane.count_step`: no rows is a steady step) and the
        frame written by another (``lane_frame``), no body or Delta made; None, nothing
        changed, without the speedups or for a step the lane's C step does not take."""
        _, _, appends, packed, drafts, counts, structured, pending, nspec, _ = scan
        computed, scheduled, outputs, _ = counts
        if _C is None:
            return None
        done = lane.count_step(computed and computed[:2], scheduled and scheduled[:2],
                               appends, check=False)
        if done is None:
            return None
        seq = mirror.lane_seq(appends is not None)
        frame = _C.lane_frame(mirror.epoch, seq, done[0], computed, scheduled, packed, drafts,
                              outputs, structured, pending, nspec)
        quick = self.quick
        if frame is None:  # values the C writer does not take: the objects, then msgspec
            body = quick.scanned_body(scan)
            frame = bytes(codec.encode(Delta(mirror.epoch, seq, done[0], body))[0])
        else:
            quick.scanned(scan)
        lane.counts_taken(done, appends, frame)
        self._quick_taken(seq)
        return [frame]

    def _plain_appended(self, mirror: EngineMirror, lane: SteadyLane, flags: DeltaBody,
                        packed: Packed) -> list[Frame]:
        """The frame of a plain step with one KV group's appends (:attr:`quick` holds
        them, ``packed`` their Rows fields; ``flags`` the step's flag body), written
        without making its body when the lane takes it directly."""
        quick = self.quick
        structured, pending = flags.has_structured_output, flags.pending_structured_output
        digest = lane.appended(quick.appends[0], None, flags, own=True)
        if digest is None:  # rows the short path does not take: the lane's step decides
            return self._same_batch(mirror, lane, DeltaBody(
                block_append=(Rows(*packed),), has_structured_output=structured,
                pending_structured_output=pending))
        seq = mirror.lane_seq(True)
        self._quick_taken(seq)
        return [codec.plain_delta_frame(mirror.epoch, seq, digest, packed, structured, pending)]

    def _start(self, so: Any) -> tuple[EngineMirror, SteadyLane]:
        """The mirror (made by the first step, which tells the KV groups) and its lane."""
        if self.mirror is None:
            if self.kv_groups is None:
                first = so.scheduled_new_reqs[0].block_ids if so.scheduled_new_reqs else (0,)
                self.kv_groups = len(first)
            self.mirror = EngineMirror(self.epoch, kv_groups=self.kv_groups, verify=self.verify)
        if self.lane is None or self.lane.state is not self.mirror.state:
            self.lane = SteadyLane(self.mirror.state)
        return self.mirror, self.lane

    def _same_batch(self, mirror: EngineMirror, lane: SteadyLane, body: DeltaBody,
                    ) -> list[Frame]:
        """The frames of a same-batch step (:class:`QuickEncoder` made ``body``): a plain
        step with one KV group's appends goes straight to :meth:`SteadyLane.appended`,
        any other to the lane's step; a body the lane refuses to the mirror's state."""
        quick = self.quick
        digest = lane.appended(quick.appends[0], None, body, own=True) \
            if quick.rows is NO_ROWS and len(quick.appends) == 1 else None
        if digest is None:
            digest = lane.step(body, quick.appends, rows=quick.rows, own_appends=True,
                               own_rows=True)
        if digest is None:
            lane.settle()
            delta = mirror.apply_body(body)
        else:
            delta = mirror.lane_delta(body, digest)
        self._quick_taken(delta.seq)
        return codec.encode(delta)

    def _general(self, mirror: EngineMirror, lane: SteadyLane, so: Any) -> list[Frame]:
        """The frames of a general step: the whole request diffed against the mirror."""
        lane.settle()
        self._file_blocks()
        ext: dict[str, Any] = {"kv_groups": self.kv_groups} if mirror.seq == 0 else {}
        request = self._request(so, ext)
        delta = mirror.diff(request, self._hint) if self.items is None else \
            self.items.diff(mirror, request, self._hint)
        self.after_general(delta.seq, request.req_ids, request.num_computed_tokens.tolist(),
                           list(so.num_scheduled_tokens.values()))
        return codec.encode(delta)

    def after_general(self, seq: int, batch: list[str], computed: list[int],
                      nsched: list[int], tables_built: bool = True) -> None:
        """After a general step (``seq``, its batch and actual counts): the lane opens
        on the new schedule, the quick encoder predicts from it, replies may name it.
        ``tables_built``: False when the step never built its whole block tables (the
        next general step then makes them from our lists)."""
        assert self.lane is not None  # noqa: S101 - made by encode
        if not tables_built:
            self._last_blocks, self._hint = None, None
        self.lane.open(computed)  # here, not in the next same-batch step
        self.quick.reset(batch, self.lane.handles, computed, nsched,
                         list(map(self.mem.plen.__getitem__, batch)), self.kv_groups or 1)
        self.batches[seq] = batch
        self.batches.pop(seq - HISTORY, None)

    def _quick_taken(self, seq: int) -> None:
        """Step ``seq`` was encoded by a same-batch path: its appended blocks are noted for
        our tables (filed by :meth:`_file_blocks` when the general path next reads them,
        or once :data:`UNFILED` steps are noted; the batch's Ragged is then stale) and
        replies may name its batch."""
        quick = self.quick
        if quick.appends:  # our own lists, not the SchedulerOutput's
            self._unfiled.append((quick.batch, quick.appends))
            self._last_blocks = None
            if len(self._unfiled) >= UNFILED:
                self._file_blocks()
        self.quick_steps += 1
        self.batches[seq] = quick.batch
        self.batches.pop(seq - HISTORY, None)

    def _file_blocks(self) -> None:
        """The noted appends into our tables, in step order."""
        tables = self.tables
        for batch, appends in self._unfiled:
            for g, (pos, counts, flat) in enumerate(appends):
                at = 0
                for p, c in zip(pos, counts, strict=True):
                    tables[batch[p]][g].extend(flat[at:at + c])
                    at += c
        self._unfiled.clear()

    def _request(self, so: Any, ext: dict[str, Any]) -> ExecuteModelRequest:
        check_scheduled(so)  # (before the encoder's memory of requests changes)
        mem, cached = self.mem, so.scheduled_cached_reqs
        self.forget(so.finished_req_ids)
        batch = list(so.num_scheduled_tokens)
        n = len(batch)
        pos = self._pos = dict(zip(batch, range(n), strict=True))
        computed = np.zeros(n, dtype=np.int64)
        self._new_requests(so.scheduled_new_reqs, batch, pos, computed, ext)
        self._cached_requests(cached, batch, pos, computed, ext)
        self._token_lists(so, batch, pos, ext)
        step_ext(so, batch, pos, ext, self.seals)
        mem.known.update(batch)
        mem.prev_batch = set(batch)
        blocks = self._block_tables(batch, so)
        wire = StepExt(**ext)
        return ExecuteModelRequest(
            req_ids=batch, specs=list(map(self.specs.__getitem__, batch)),
            num_scheduled_tokens=np.fromiter(so.num_scheduled_tokens.values(), np.int64, n),
            num_computed_tokens=computed, block_tables=blocks,
            spec_token_ids=keyed_rows(so.scheduled_spec_decode_tokens, batch, shift=1),
            encoder_inputs=keyed_rows(so.scheduled_encoder_inputs, batch),
            finished_req_ids=frozenset(so.finished_req_ids),
            preempted_req_ids=frozenset(so.preempted_req_ids or ()),
            resumed_req_ids=frozenset(cached.resumed_req_ids),
            free_encoder_mm_hashes=tuple(so.free_encoder_mm_hashes),
            blocks_to_zero=None if so.new_block_ids_to_zero is None
            else np.asarray(so.new_block_ids_to_zero, dtype=np.int64),
            has_structured_output_requests=so.has_structured_output_requests,
            pending_structured_output_tokens=so.pending_structured_output_tokens,
            num_spec_tokens_to_schedule=so.num_spec_tokens_to_schedule,
            extension={"v": msgspec.msgpack.encode(wire)} if wire != StepExt() else {})

    def forget(self, finished: set[str]) -> None:
        """Drop finished requests from the encoder's memory, specs and tables."""
        self.mem.finish(finished)
        for rid in finished:
            self.specs.pop(rid, None)
            self.tables.pop(rid, None)

    def _block_tables(self, batch: list[str], so: Any) -> tuple[Ragged, ...]:
        """Whole tables in batch order: last step's with its rows that left dropped, this
        step's appends patched in and rows joining at the end made from our lists; all
        made from our lists when last step's are unknown or a request resumed."""
        cached = so.scheduled_cached_reqs
        last = self._last_blocks
        carried = None if last is None or cached.resumed_req_ids else \
            self._carried(last, batch, {nr.req_id for nr in so.scheduled_new_reqs})
        self._hint = None
        if carried is None:
            tables = tuple(ragged([self.tables[rid][g] for rid in batch])
                           for g in range(self.kv_groups or 1))
        else:
            tables, kept = carried
            pos = self._pos
            ids, nbs = cached.req_ids, cached.new_block_ids
            grown = sorted((pos[ids[k]], k) for k in _not_none(nbs) if pos[ids[k]] < kept)
            rows = [p for p, _ in grown]
            new = [[cached.new_block_ids[k][g] for _, k in grown] for g in range(len(tables))]
            if grown:
                tables = tuple(append_rows(t, rows, new[g]) for g, t in enumerate(tables))
            self._hint = table_hint(kept, rows, new)
        self._last_blocks, self._last_batch = tables, batch
        return tables

    def _carried(self, last: tuple[Ragged, ...], batch: list[str], new: set[str],
                 ) -> tuple[tuple[Ragged, ...], int] | None:
        """(last step's tables without the rows that left, with the rows past them made
        from our lists; how many rows were carried) when ``batch`` is last step's batch
        less some requests, in the same order, plus requests it did not hold at the end
        (``new``: requests whose tables start afresh this step, never carried); else
        None.  The carried rows still lack this step's appends."""
        prev = self._last_batch
        if batch == prev and not new:
            return last, len(batch)
        pos = self._pos
        keep = list(map(pos.__contains__, prev))
        if not new.isdisjoint(prev):
            keep = [k and rid not in new for k, rid in zip(keep, prev, strict=True)]
        kept = keep.count(True)
        if list(compress(prev, keep)) != batch[:kept]:
            return None  # reordered: the general rebuild
        mask = np.array(keep, dtype=bool)
        tables = []
        for g, table in enumerate(last):
            rows = ragged([self.tables[rid][g] for rid in batch[kept:]])
            values = table.values[np.repeat(mask, table.lengths)]
            tables.append(Ragged(np.concatenate([table.lengths[mask], rows.lengths]),
                                 np.concatenate([values, rows.values])))
        return tuple(tables), kept

    # ------------------------------------------------------------ requests
    def _new_requests(self, new_reqs: list[Any], batch: list[str], pos: dict[str, int],
                      computed: IntArray, ext: dict[str, Any]) -> None:
        known = self.mem.known
        new_pos = [pos[nr.req_id] for nr in new_reqs]
        unknown = compress(range(len(batch)), map(not_, map(known.__contains__, batch)))
        flips = sorted(set(new_pos).symmetric_difference(unknown))
        if flips:
            ext["new_flip"] = pack_uints(flips)
        if new_pos != sorted(new_pos):
            ext["new_order"] = pack_uints(sorted(range(len(new_pos)), key=new_pos.__getitem__))
        fixes, prefill = [], []
        for k, nr in enumerate(new_reqs):
            spec, fix = new_request_spec(nr, k, self.spec_reader)
            old = self.specs.get(nr.req_id)
            self.specs[nr.req_id] = old if old is not None and _same_spec(old, spec) else spec
            self.mem.remember(spec)
            self.tables[nr.req_id] = [list(b) for b in nr.block_ids]
            computed[pos[nr.req_id]] = nr.num_computed_tokens
            fixes += [fix] if fix is not None else []
            prefill.append(None if nr.prefill_token_ids is None else
                           make_ref(nr.prefill_token_ids, spec.prompt_token_ids,
                                    self.mem.held(nr.req_id)))
            self.mem.mrv2 |= nr.prefill_token_ids is not None
        if fixes:
            ext["fixes"] = tuple(fixes)
        if any(p is not None for p in prefill):
            ext["prefill"] = tuple(prefill)

    def _cached_requests(self, cached: Any, batch: list[str], pos: dict[str, int],
                         computed: IntArray, ext: dict[str, Any]) -> None:
        resumed, ids = cached.resumed_req_ids, cached.req_ids
        for name in ("new_block_ids", "num_computed_tokens", "num_output_tokens"):
            if len(getattr(cached, name)) != len(ids):
                raise LocalProtocolError("a CachedRequestData list is not one entry per request",
                                         field=name, entries=len(getattr(cached, name)),
                                         requests=len(ids))
        cpos = list(map(pos.__getitem__, ids))
        if cpos != cached_order(sorted(cpos), batch, resumed):
            ext["cached_order"] = pack_uints(cpos)
        unknown = set(ids) - self.specs.keys()
        if unknown:
            raise LocalProtocolError("cached request was never scheduled", req_id=min(unknown))
        none_flip = self._cached_blocks(ids, cached.new_block_ids, resumed)
        if none_flip:
            ext["none_flip"] = pack_uints(none_flip)
        comp = np.asarray(cached.num_computed_tokens, dtype=np.int64)
        computed[cpos] = comp
        departures = self.mem.output_departures(ids, comp, cached.num_output_tokens)
        if departures is not None:
            ext["out_pos"], ext["out_delta"] = departures

    def _cached_blocks(self, ids: list[str], blocks: list[Any], resumed: set[str]) -> list[int]:
        """Apply new_block_ids (replacing for resumed ids); positions sending () not None."""
        none_flip = []
        for k in _not_none(blocks):
            rid, new = ids[k], blocks[k]
            if not any(new):
                none_flip.append(k)
            self.tables[rid] = [list(b) for b in new] if rid in resumed else \
                [t + b for t, b in zip(self.tables[rid], new, strict=True)]
        for rid in resumed:
            if blocks[ids.index(rid)] is None:
                self.tables[rid] = [[] for _ in self.tables[rid]]
        return none_flip

    def _token_lists(self, so: Any, batch: list[str], pos: dict[str, int],
                     ext: dict[str, Any]) -> None:
        cached = so.scheduled_cached_reqs
        if cached.new_token_ids:
            lists = cached.new_token_ids
            flat = [t for row in lists for t in row]
            ext["new_tokens"] = (pack_uints([len(r) for r in lists]), pack_sints(flat))
        predicted = [] if self.mem.mrv2 else \
            list(filterfalse(self.mem.prev_batch.__contains__, cached.req_ids))
        keys = list(cached.all_token_ids)
        if keys != predicted:
            index = dict(zip(cached.req_ids, range(len(cached.req_ids)), strict=True))
            ext["all_keys"] = _packed([index[k] for k in keys])
        if keys:
            ext["all_tokens"] = tuple(self._ref(rid, toks)
                                      for rid, toks in cached.all_token_ids.items())

    def _ref(self, rid: str, tokens: list[int]) -> TokenRef:
        return make_ref(tokens, self.mem.prompt.get(rid), self.mem.held(rid))

    # ------------------------------------------------------------ sample_tokens
    def encode_grammar(self, grammar: Any) -> list[Frame]:
        """GrammarOutput of the step just encoded: ids as batch positions, bitmask zero-copy
        (None: one empty frame)."""
        if grammar is None:  # most steps: nothing else to read
            return [b""]
        return self._grammar.encode(grammar, self.seq, self.batches.get(self.seq, []),
                                    self.quick)

    # ------------------------------------------------------------ replies
    def decode_reply(self, frames: list[Any]) -> Any:
        """The worker's ModelRunnerOutput (fresh objects); feeds the token ledger."""
        out = decode_reply(frames, self.batches, self.seals, self._index)
        if out is not None:
            self.mem.record_output(out)
        return out


def _same_spec(a: RequestSpec, b: RequestSpec) -> bool:
    from protocol.request import _same_value

    return _same_value(a, b)
