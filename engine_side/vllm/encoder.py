"""Engine side: vLLM ``SchedulerOutput`` → one Delta (frames); replies back: :mod:`.replies`.

Theory of operation
-------------------
A SchedulerOutput is already a delta: new requests with their whole tables, cached
requests with their new blocks and counts, finished ids, each request's scheduled
count in batch order.  :meth:`SchedulerOutputEncoder.encode` reads those fields once
into the mirror's step (:meth:`engine_side.mirror.EngineMirror.step`), which writes
the body -- the schedule's edits and the counts that depart from the protocol's
predictions -- and applies it to the engine's copy of the state.  What the core body
has no field for (list orders, output counts, rare flags, connector objects, sealed)
travels in a :class:`protocol.ext.StepExt`, and only where it departs from what the
receiver predicts, so a same-batch step adds nothing.  One path: a step where nothing
joins or leaves is the same code with empty parts.

Contract: ``encode`` reads the SchedulerOutput synchronously and keeps no reference to
it (the engine mutates it after dispatch).  Steps reach the ranks in order; the
transport adds sequencing, retransmission and liveness.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, compress, repeat
from operator import is_not
from typing import Any

import numpy as np

from engine_side.mirror import BlockRows, EngineMirror
from engine_side.shm_store import ShmStore
from engine_side.vllm.grammar import GrammarEncoder
from engine_side.vllm.mm import StoreChannel
from engine_side.vllm.params import SpecReader, request_entry
from engine_side.vllm.replies import IndexCache, decode_reply
from engine_side.vllm.schema import check_schema
from protocol import codec, kernels
from protocol.codec import Frame
from protocol.errors import LocalProtocolError
from protocol.ext import OutputCounts, StepExt, encode_ext, make_ref
from protocol.messages import Rows
from protocol.packing import pack_sints, pack_uints, unpack_uint_list
from protocol.seal import ChannelSeals

HISTORY = 8  # steps whose batch replies and grammar outputs may still name
#: connector metadata fields: arbitrary objects, sealed into the extension
CONNECTOR_FIELDS = ("kv_connector_metadata", "ec_connector_metadata",
                    "aux_output_connector_metadata", "ec_manager_metadata")


def _positions_of(values: list[Any]) -> list[int]:
    """Positions of the entries that are not None (C-level maps)."""
    return list(compress(range(len(values)), map(is_not, values, repeat(None))))


def _ints(values: list[int], n: int, what: str) -> Any:
    """A list of ints of a SchedulerOutput as an int64 array (LocalProtocolError unless it
    holds ``n`` of them)."""
    if len(values) != n:
        raise LocalProtocolError(f"{what} is not one entry per cached request",
                                 entries=len(values), requests=n)
    return np.fromiter(values, np.int64, n)


def _row(rows: BlockRows, p: int, ids: list[int]) -> None:
    rows[0].append(p)
    rows[1].append(len(ids))
    rows[2].extend(ids)


def _rows(keyed: dict[str, list[int]], pos: dict[str, int], shift: int = 0) -> Rows | None:
    """A per-request dict as Rows keyed by batch position, in the dict's order."""
    if not keyed:
        return None
    try:
        keys = [pos[k] for k in keyed]
    except KeyError as exc:
        raise LocalProtocolError("a per-request field names an unscheduled request",
                                 req_id=str(exc)) from None
    values = [v + shift for row in keyed.values() for v in row]
    counts = list(map(len, keyed.values()))
    return Rows(keys=pack_uints(keys), counts=b"" if counts.count(1) == len(counts)
                else pack_uints(counts), values=pack_uints(values))


class SchedulerOutputEncoder:
    """Stateful SchedulerOutput → frames (one Delta message per step).

    Args:
        kv_groups: KV-cache groups; None infers it from the first new request.
        secret: per-run HMAC key for connector metadata (None: refuse such metadata).
        epoch: the mirror's epoch.
        store: the host's shared-memory store when every rank of this channel is attached
            to it: multimodal items and prompt embeds are then written once and sent by
            reference (:mod:`engine_side.vllm.mm`); None: inline tensor frames.
    """

    def __init__(self, kv_groups: int | None = None, secret: bytes | None = None,
                 epoch: int = 1, store: ShmStore | None = None) -> None:
        check_schema()
        self.kv_groups, self.epoch = kv_groups, epoch
        self.mirror: EngineMirror | None = None
        self.outputs = OutputCounts()
        self.reader = SpecReader()
        self.seals = ChannelSeals(secret, b"step", b"reply")
        self.batches: dict[int, list[str]] = {}
        self._pos: dict[str, int] = {}
        self._pos_batch: list[str] = []
        self._grammar = GrammarEncoder()
        self._index = IndexCache()
        self.items = None if store is None else StoreChannel(store)

    @property
    def seq(self) -> int:
        return 0 if self.mirror is None else self.mirror.seq

    def _start(self, so: Any) -> EngineMirror:
        if self.kv_groups is None:
            first = so.scheduled_new_reqs[0].block_ids if so.scheduled_new_reqs else (0,)
            self.kv_groups = len(first)
        self.mirror = EngineMirror(self.epoch, kv_groups=self.kv_groups, keep_tables=False)
        return self.mirror

    def _positions(self, batch: list[str]) -> dict[str, int]:
        """Batch positions by id (made once per batch)."""
        if batch != self._pos_batch:
            self._pos_batch, self._pos = batch, dict(zip(batch, range(len(batch)),
                                                         strict=True))
        return self._pos

    # ------------------------------------------------------------ execute_model
    def encode(self, so: Any, restored: dict[str, list[int]] | None = None) -> list[Frame]:
        """Frames of one step (one Delta message); ``restored``: the tokens sampled before
        a restart by new requests that resume (SPEC §16 ``ro``).

        Raises LocalProtocolError for a stream vLLM cannot produce (a cached request
        never scheduled, ...); the encoder is then unusable: start a new epoch.
        """
        mirror = self.mirror or self._start(so)
        cached, new_reqs, nst = so.scheduled_cached_reqs, so.scheduled_new_reqs, \
            so.num_scheduled_tokens
        batch, counts = list(nst), list(nst.values())
        cids, ccomp = cached.req_ids, cached.num_computed_tokens
        groups = mirror.state.kv_groups
        ext: dict[str, Any] = {"kv_groups": groups} if mirror.seq == 0 else {}
        pos: dict[str, int] | None = None
        cpos: list[int] | None = None  # the cached rows' batch positions (None: 0, 1, ...)
        new_at: list[int] = []  # the new requests' batch positions
        computed: list[int] | None = ccomp
        resumed = cached.resumed_req_ids
        if cids == batch and batch == mirror.batch and not so.finished_req_ids \
                and not resumed and not new_reqs:
            # the last batch again, every row cached in order (the steady step): compare
            # the counts with the prediction here, where the arrays are at hand
            handles, state = mirror.state.schedule, mirror.state
            comp = state.cols.computed[handles] + state.nsched
            if len(ccomp) == comp.size and not kernels.mismatches(ccomp, comp):
                computed = None  # as predicted (the common step: no exception row)
            else:
                comp = _ints(ccomp, len(batch), "num_computed_tokens")
        else:
            if cids != batch or resumed or new_reqs:  # (resumed: a rank predicts them last)
                cpos, computed, new_at = self._placed(so, batch, ext)
            try:
                handles = np.fromiter(map(mirror.ids.__getitem__, cids), np.int64, len(cids))
            except KeyError as exc:
                raise LocalProtocolError("a cached request was never scheduled",
                                         req_id=str(exc)) from None
            comp = _ints(ccomp, len(cids), "num_computed_tokens")
        entries, plens = [], []
        fixes, prefill = [], []
        for k, nr in enumerate(new_reqs):
            entry, fix, plen = request_entry(nr, k, self.reader)
            entries.append(entry)
            plens.append(plen)
            if fix is not None:
                fixes.append(fix)
            prefill.append(None if nr.prefill_token_ids is None else
                           make_ref(nr.prefill_token_ids, nr.prompt_token_ids))
        if fixes:
            ext["fixes"] = tuple(fixes)
        if restored:
            ext["restored"] = tuple((k, pack_sints(restored[nr.req_id]))
                                    for k, nr in enumerate(new_reqs) if nr.req_id in restored)
        if prefill and any(r is not None for r in prefill):
            ext["prefill"] = tuple(prefill)
        self._token_lists(cached, ext)
        appends, replaces = self._blocks(so, groups, cpos, new_at)
        dep = self.outputs.departures(handles, comp, cached.num_output_tokens) if cids else None
        if dep is not None:
            ext["out_pos"], ext["out_delta"] = dep
        drafts, inputs = so.scheduled_spec_decode_tokens, so.scheduled_encoder_inputs
        if drafts or inputs:
            pos = pos or self._positions(batch)
        self._rare(so, counts, ext)
        if self.items is not None:  # two-phase: the step's puts undone if it fails
            entries = self.items.place(entries, so)
        try:
            delta, applied = mirror.step(
                batch, counts, finished=so.finished_req_ids, added=entries, computed=computed,
                appends=appends, replaces=replaces,
                spec_tokens=_rows(drafts, pos, 1) if drafts else None,  # type: ignore[arg-type]
                encoder_inputs=_rows(inputs, pos) if inputs else None,  # type: ignore[arg-type]
                preempted=so.preempted_req_ids or (), resumed=resumed,
                free_encoder_mm_hashes=tuple(so.free_encoder_mm_hashes),
                blocks_to_zero=so.new_block_ids_to_zero,
                structured=so.has_structured_output_requests,
                pending=so.pending_structured_output_tokens,
                num_spec=so.num_spec_tokens_to_schedule,
                extension=encode_ext(StepExt(**ext)) if ext else b"")
        except BaseException:
            if self.items is not None:
                self.items.abort()
            raise
        if self.items is not None:
            self.items.commit()
        for h, plen in zip(applied.added, plens, strict=True):
            self.outputs.add(h, plen)
        self.batches[delta.seq] = batch
        self.batches.pop(delta.seq - HISTORY, None)
        return codec.encode(delta)

    # ------------------------------------------------------------ sample_tokens
    def encode_grammar(self, grammar: Any) -> list[Frame]:
        """GrammarOutput of the step just encoded (None: one empty frame)."""
        if grammar is None:
            return [b""]
        batch = self.batches.get(self.seq, [])
        return self._grammar.encode(grammar, self.seq, batch, self._positions(batch))

    # ------------------------------------------------------------ replies
    def decode_reply(self, frames: list[Any]) -> Any:
        """The rank's ModelRunnerOutput (fresh objects), or None."""
        return decode_reply(frames, self.batches, self.seals, self._index)

    def _placed(self, so: Any, batch: list[str], ext: dict[str, Any],
                ) -> tuple[list[int] | None, list[int], list[int]]:
        """(each cached request's batch position, None where they are the batch's first
        rows in order; each row's computed count; each new request's batch position) of
        a step whose cached requests are not the whole batch in order.  The cached order
        departs when it is not running-then-resumed in batch order."""
        cached, new_reqs = so.scheduled_cached_reqs, so.scheduled_new_reqs
        cids, resumed = cached.req_ids, cached.resumed_req_ids
        m = len(cids)
        if len(cached.num_computed_tokens) != m:
            raise LocalProtocolError("num_computed_tokens is not one per cached request",
                                     counts=len(cached.num_computed_tokens), requests=m)
        if not resumed and len(batch) == m + len(new_reqs) and batch[:m] == cids \
                and all(r == nr.req_id for r, nr in zip(batch[m:], new_reqs, strict=True)):
            # the common shape: the cached requests, then the new ones, in batch order
            return None, [*cached.num_computed_tokens,
                          *(nr.num_computed_tokens for nr in new_reqs)], \
                list(range(m, len(batch)))
        pos = self._positions(batch)
        if m + len(new_reqs) != len(batch) or not all(nr.req_id in pos for nr in new_reqs):
            raise LocalProtocolError("num_scheduled_tokens must name each new and cached "
                                     "request once")
        try:
            cpos = [pos[r] for r in cids]
        except KeyError as exc:
            raise LocalProtocolError("a cached request is not scheduled",
                                     req_id=str(exc)) from None
        computed = [0] * len(batch)
        for p, c in zip(cpos, cached.num_computed_tokens, strict=True):
            computed[p] = c
        new_at = [pos[nr.req_id] for nr in new_reqs]
        for p, nr in zip(new_at, new_reqs, strict=True):
            computed[p] = nr.num_computed_tokens
        predicted = sorted(cpos)
        if resumed:
            predicted = [p for p in predicted if batch[p] not in resumed] + \
                [p for p in predicted if batch[p] in resumed]
        if cpos != predicted:
            ext["cached_order"] = pack_uints(cpos)
        return cpos, computed, new_at

    def _blocks(self, so: Any, groups: int, cpos: list[int] | None, new_at: list[int],
                ) -> tuple[Sequence[BlockRows | None], Sequence[BlockRows | None]]:
        """Per KV group, the rows appended (new requests' whole tables, cached requests'
        new blocks) and replaced (resumed requests' tables); a cached request whose new
        blocks are all empty lists (not None) gets a row of no ids."""
        cached, new_reqs = so.scheduled_cached_reqs, so.scheduled_new_reqs
        nb = cached.new_block_ids
        if len(nb) != len(cached.req_ids):
            raise LocalProtocolError("new_block_ids is not one entry per cached request")
        some = nb.count(None) != len(nb)
        if not some and not new_reqs:
            return (), ()
        app: list[BlockRows] = [([], [], []) for _ in range(groups)]
        rep: list[BlockRows] = [([], [], []) for _ in range(groups)]
        for nr, p in zip(new_reqs, new_at, strict=True):
            if len(nr.block_ids) != groups:
                raise LocalProtocolError("a new request's blocks are not one list per KV "
                                         "group", req_id=nr.req_id, groups=groups)
            for g, ids in enumerate(nr.block_ids):
                if ids:
                    _row(app[g], p, ids)
        at = _positions_of(nb) if some else []
        resumed, cids = cached.resumed_req_ids, cached.req_ids
        if groups == 1 and not resumed and all(len(nb[k]) == 1 for k in at):
            # one list a row, all appended (a request with no new ids: its row of none)
            firsts = [nb[k][0] for k in at]
            app[0][0].extend(at if cpos is None else [cpos[k] for k in at])
            app[0][1].extend(map(len, firsts))
            app[0][2].extend(chain.from_iterable(firsts))
        else:
            for k in at:
                new, p = nb[k], k if cpos is None else cpos[k]
                if len(new) != groups:
                    raise LocalProtocolError("new blocks are not one list per KV group")
                rows = rep if resumed and cids[k] in resumed else app
                marked = False
                for g, ids in enumerate(new):
                    if ids:
                        _row(rows[g], p, ids)
                        marked = True
                if not marked:
                    _row(rows[0], p, [])
        return ([r if r[0] else None for r in app], [r if r[0] else None for r in rep])

    def _rare(self, so: Any, counts: list[int], ext: dict[str, Any]) -> None:
        """The extension entries of a step's rare fields that depart from what the
        receiver predicts, and its connector metadata sealed."""
        if so.total_num_scheduled_tokens != sum(counts):
            ext["total"] = so.total_num_scheduled_tokens
        if so.preempted_req_ids is None:
            ext["preempted_none"] = True
        stats = so.scheduled_encoder_input_stats
        if stats is not None:
            ext["enc_stats"] = (stats.num_inputs, stats.output_tokens)
        if so.num_invalid_spec_tokens is not None:
            ext["invalid_spec"] = dict(so.num_invalid_spec_tokens)
        if so.has_sync_kv_loads:
            ext["sync_kv"] = True
        copies = so.kv_cache_block_copies
        if copies is not None:
            ext["block_copies"] = pack_uints([v for c in copies for v in c]) if copies else b""
        if so.num_common_prefix_blocks != []:
            ext["prefix_blocks"] = pack_uints(so.num_common_prefix_blocks)
        if so.kv_connector_block_state is not None:
            raise LocalProtocolError("kv_connector_block_state is scheduler-local")
        if so.kv_connector_metadata is not None or so.ec_connector_metadata is not None \
                or so.aux_output_connector_metadata is not None \
                or so.ec_manager_metadata is not None:  # (CONNECTOR_FIELDS)
            ext["sealed"] = self.seals.seal({f: getattr(so, f) for f in CONNECTOR_FIELDS
                                             if getattr(so, f) is not None})

    def _token_lists(self, cached: Any, ext: dict[str, Any]) -> None:
        """Cached requests' token lists (pipeline parallelism's new tokens, the history
        of requests not scheduled last step), the latter as prompt references."""
        if cached.new_token_ids:
            lists = cached.new_token_ids
            ext["new_tokens"] = (pack_uints(list(map(len, lists))),
                                 pack_sints([t for row in lists for t in row]))
        every = cached.all_token_ids
        if every:
            at = {r: k for k, r in enumerate(cached.req_ids)}
            try:
                ext["all_keys"] = pack_uints([at[r] for r in every])
            except KeyError as exc:
                raise LocalProtocolError("all_token_ids names a request that is not cached",
                                         req_id=str(exc)) from None
            state, ids = self.mirror.state, self.mirror.ids  # type: ignore[union-attr]
            ext["all_tokens"] = tuple(make_ref(toks, _prompt(state.specs[ids[r]]))
                                      for r, toks in every.items())


def _prompt(spec: Any) -> list[int] | None:
    return None if spec.prompt_none else unpack_uint_list(spec.prompt)
