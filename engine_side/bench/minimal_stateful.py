"""A minimal stateful channel for vLLM steps: what statefulness alone costs in Python.

A yardstick for the vLLM streams benchmark, not a product path.  Like deltacast it keeps
state on both ends and sends only what the receiver cannot predict -- handles for request
ids, computed and output counts where they depart from the last step's, the scheduled
counts when they change, new blocks, joins and leaves -- and the rank hands its runner a
plain ``SchedulerOutput``.  Unlike deltacast it does nothing else: its body is one msgspec
struct (encoded and decoded in C), its state is dicts and lists, and it keeps no digest,
checks nothing a peer sends (a malformed body may raise anything or build a wrong step),
has no resync and no multimodal, pooling, LoRA or connector support (:class:`Unsupported`).
With ``digest``, both ends also keep a state digest built from deltacast's digest terms
(each request's spec hash, computed counts keyed by handle, block rows, the schedule term)
and updated by what each step changes; the rank refuses a step whose digest differs
(:class:`DigestMismatch`): what the one state machine would cost if it kept plain lists.
So it shows what a stateful Python channel that does no more than this pays per step at
the batch sizes servers run (its plain lists lose to deltacast's numpy columns at
thousands of requests).  Exact on the recorded streams (``tests/test_minimal_stateful.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import msgspec
import numpy as np

from protocol import digest as dg

#: SchedulerOutput fields that are rarely set, sent in one msgpack map when they are
RARE = ("scheduled_spec_decode_tokens", "scheduled_encoder_inputs", "num_common_prefix_blocks",
        "free_encoder_mm_hashes", "has_structured_output_requests",
        "pending_structured_output_tokens", "num_invalid_spec_tokens", "has_sync_kv_loads",
        "new_block_ids_to_zero", "num_spec_tokens_to_schedule")
#: fields holding objects msgpack cannot carry: a step that sets one is unsupported
OBJECTS = ("scheduled_encoder_input_stats", "kv_connector_metadata",
           "aux_output_connector_metadata", "ec_connector_metadata", "ec_manager_metadata",
           "kv_cache_block_copies", "kv_connector_block_state")


class Unsupported(Exception):
    """A step with a feature the minimal channel does not carry."""


class DigestMismatch(Exception):
    """The rank's state digest differs from the engine's."""


class _New(msgspec.Struct, array_like=True):
    handle: int
    req_id: str
    prompt: list[int] | None
    params: msgspec.Raw  # the SamplingParams struct, or nil
    blocks: list[list[int]]
    computed: int


class _Body(msgspec.Struct, array_like=True, omit_defaults=True):
    new: list[_New] = []
    finished: list[int] = []
    finished_unknown: list[str] = []  # finished before they were ever scheduled
    order: list[int] | None = None  # cached handles, when not last step's scheduled ones
    computed: list[int] | None = None  # every cached computed count (with ``order``) ...
    computed_at: list[int] = []  # ... or the positions departing from prediction
    computed_to: list[int] = []
    outputs: list[int] | None = None  # output counts: all (with ``order``) ...
    outputs_at: list[int] = []  # ... or those departing from last step's + 1
    outputs_to: list[int] = []
    blocks_at: list[int] = []
    blocks: list[list[list[int]]] = []
    counts: list[int] | None = None  # scheduled counts in dict order, when they change
    count_order: list[int] | None = None  # the dict's handles, when not cached + new
    resumed: list[int] = []
    rare: bytes = b""
    digest: int = 0  # with ``digest``: the state digest after the step


_ENCODE = msgspec.msgpack.Encoder()
_BODY = msgspec.msgpack.Decoder(_Body)


class _Digest:
    """A state digest kept as deltacast keeps its own: a sum of terms, each updated by
    what a step changes (a steady step: one addition)."""

    def __init__(self) -> None:
        self.terms = 0  # spec and block terms of the live requests
        self.spec: dict[int, int] = {}
        self.rows: dict[int, list[tuple[int, int]]] = {}  # per group (length, term sum)
        self.computed = self.advance = self.schedule = 0

    def step(self, b: _Body, hs: list[int], computed: list[int], counts: list[int],
             was: list[int]) -> int:
        """The digest after a step whose body is ``b``: ``hs``, the cached handles;
        ``computed``, every scheduled request's count (cached, then new); ``was``, the
        predictions the body's computed departures replace."""
        for h in b.finished:
            self.terms -= self.spec.pop(h) + sum(t for _, t in self.rows.pop(h))
        for n in b.new:
            self.spec[n.handle] = dg.spec_term(n.handle, n.params)
            self.rows[n.handle] = [(0, 0)] * len(n.blocks)
            self.terms += self.spec[n.handle] + self._append([n.handle], [n.blocks])
        if b.blocks_at:
            self.terms += self._append([hs[i] for i in b.blocks_at], b.blocks)
        if b.order is not None or b.counts is not None or b.new or b.count_order:
            order = np.array(b.count_order or hs + [n.handle for n in b.new], dtype=np.int64)
            scheduled = np.array(counts, dtype=np.int64)
            self.advance = dg.keyed_sum(order, scheduled)
            self.schedule = dg.schedule_term(order, scheduled)
            self.computed = dg.keyed_sum(order, np.array(computed, dtype=np.int64))
        else:  # the schedule again: each count advances, departures corrected
            self.computed += self.advance + sum(
                (v - p) * dg.handle_key(hs[i])
                for i, v, p in zip(b.computed_at, b.computed_to, was, strict=True))
        return (self.terms + self.computed + self.schedule) & dg.MASK

    def _append(self, hs: list[int], blocks: list[list[list[int]]]) -> int:
        """Blocks appended to handles ``hs`` (per handle, per group): their terms."""
        added = 0
        for g in range(len(blocks[0])):
            ids = [b[g] for b in blocks]
            sums = dg.block_row_terms(hs, g, [self.rows[h][g][0] for h in hs],
                                      list(map(len, ids)), [v for row in ids for v in row])
            for h, row, t in zip(hs, ids, sums, strict=True):
                length, total = self.rows[h][g]
                self.rows[h][g] = (length + len(row), (total + t) & dg.MASK)
            added += sum(sums)
        return added


class MinimalEncoder:
    """Engine side: SchedulerOutput → bytes (``digest``: with the state digest)."""

    def __init__(self, digest: bool = False) -> None:
        self.digest = _Digest() if digest else None
        self.handles: dict[str, int] = {}
        self.free: list[int] = []
        self.order: list[int] = []  # last step's scheduled handles, dict order
        self.predicted: list[int] = []  # their computed counts after the step
        self.outputs: list[int] = []
        self.counts: list[int] = []

    def encode(self, so: Any) -> bytes:
        if any(getattr(so, f) is not None for f in OBJECTS):
            raise Unsupported("connector or encoder objects")
        handles, b = self.handles, _Body()
        for rid in so.finished_req_ids:
            h = handles.pop(rid, None)
            if h is None:
                b.finished_unknown.append(rid)
            else:
                b.finished.append(h)
                self.free.append(h)
        for r in so.scheduled_new_reqs:
            if (r.mm_features or r.pooling_params or r.lora_request or r.replay_start
                    or r.prompt_embeds is not None or r.prompt_is_token_ids is not None
                    or r.prefill_token_ids is not None):
                raise Unsupported("multimodal, pooling, LoRA or prompt-embeds request")
            h = self.free.pop() if self.free else len(handles)
            handles[r.req_id] = h
            b.new.append(_New(h, r.req_id, r.prompt_token_ids,
                              msgspec.Raw(_ENCODE.encode(r.sampling_params)),
                              list(r.block_ids), r.num_computed_tokens))
        c = so.scheduled_cached_reqs
        hs = [handles[r] for r in c.req_ids]
        computed, outputs = c.num_computed_tokens, c.num_output_tokens
        if hs != self.order:
            b.order, b.computed, b.outputs = hs, computed, outputs
        else:
            b.computed_at, b.computed_to = _departures(computed, self.predicted)
            b.outputs_at, b.outputs_to = _departures(outputs, [n + 1 for n in self.outputs])
        nb = c.new_block_ids
        if nb.count(None) != len(nb):
            b.blocks_at = [i for i, x in enumerate(nb) if x is not None]
            b.blocks = [list(nb[i]) for i in b.blocks_at]
        if c.resumed_req_ids:
            b.resumed = [handles[r] for r in c.resumed_req_ids]
        nst = so.num_scheduled_tokens
        ids, counts = list(nst), list(nst.values())
        if ids != c.req_ids + [r.req_id for r in so.scheduled_new_reqs]:
            b.count_order = [handles[r] for r in ids]
        if counts != self.counts:
            b.counts = counts
        rare = _rare(so, c)
        if rare:
            b.rare = _ENCODE.encode(rare)
        start = computed + [r.num_computed_tokens for r in so.scheduled_new_reqs]
        if self.digest is not None:
            b.digest = self.digest.step(b, hs, start, counts,
                                        [self.predicted[i] for i in b.computed_at])
        # the next step's predictions (a reordered dict: none, the next step sends all)
        self.order = [] if b.count_order else hs + [n.handle for n in b.new]
        self.counts = counts
        self.predicted = [s + n for s, n in zip(start, counts, strict=True)]
        self.outputs = outputs + [0] * len(b.new)
        return _ENCODE.encode(b)


class MinimalDecoder:
    """Rank side: bytes → a plain SchedulerOutput (``digest``: checked)."""

    def __init__(self, digest: bool = False) -> None:
        self.digest = _Digest() if digest else None
        self.ids: dict[int, str] = {}
        self.params: dict[bytes, Any] = {}
        self.order: list[int] = []
        self.predicted: list[int] = []
        self.outputs: list[int] = []
        self.counts: list[int] = []

    def decode(self, data: bytes) -> Any:
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

        b, ids = _BODY.decode(data), self.ids
        finished = {ids.pop(h) for h in b.finished}
        finished.update(b.finished_unknown)
        new = []
        for n in b.new:
            ids[n.handle] = n.req_id
            new.append(NewRequestData(
                req_id=n.req_id, prompt_token_ids=n.prompt, mm_features=[],
                sampling_params=self._params(bytes(n.params)), pooling_params=None,
                block_ids=tuple(n.blocks), num_computed_tokens=n.computed, lora_request=None))
        was: list[int] = []
        if b.order is not None:
            hs, computed, outputs = b.order, b.computed or [], b.outputs or []
        else:
            hs = self.order
            was = [self.predicted[i] for i in b.computed_at]
            computed = _with(self.predicted, b.computed_at, b.computed_to)
            outputs = _with([n + 1 for n in self.outputs], b.outputs_at, b.outputs_to)
        blocks: list[Any] = [None] * len(hs)
        for i, v in zip(b.blocks_at, b.blocks, strict=True):
            blocks[i] = tuple(v)
        req_ids = [ids[h] for h in hs]
        rare = msgspec.msgpack.decode(b.rare) if b.rare else {}
        counts = self.counts if b.counts is None else b.counts
        keys = [ids[h] for h in b.count_order] if b.count_order else \
            req_ids + [n.req_id for n in b.new]
        cached = CachedRequestData(
            req_ids=req_ids, resumed_req_ids={ids[h] for h in b.resumed},
            new_token_ids=rare.pop("new_token_ids", []),
            all_token_ids=rare.pop("all_token_ids", {}), new_block_ids=blocks,
            num_computed_tokens=computed, num_output_tokens=outputs)
        preempted = rare.pop("preempted_req_ids", None)
        so = SchedulerOutput(
            scheduled_new_reqs=new, scheduled_cached_reqs=cached,
            num_scheduled_tokens=dict(zip(keys, counts, strict=True)),
            total_num_scheduled_tokens=sum(counts),
            scheduled_spec_decode_tokens=rare.pop("scheduled_spec_decode_tokens", {}),
            scheduled_encoder_inputs=rare.pop("scheduled_encoder_inputs", {}),
            finished_req_ids=finished,
            free_encoder_mm_hashes=rare.pop("free_encoder_mm_hashes", []),
            preempted_req_ids=None if preempted is None else set(preempted), **rare)
        start = computed + [n.computed for n in b.new]
        if self.digest is not None and self.digest.step(b, hs, start, counts, was) != b.digest:
            raise DigestMismatch(f"state digest {b.digest:#x} expected")
        self.order = [] if b.count_order else hs + [n.handle for n in b.new]
        self.predicted = [s + n for s, n in zip(start, counts, strict=True)]
        self.counts, self.outputs = counts, outputs + [0] * len(b.new)
        return so

    def _params(self, raw: bytes) -> Any:
        """The request's SamplingParams: decoded once per distinct encoding, then copied."""
        base = self.params.get(raw)
        if base is None:
            base = self.params[raw] = _sampling_params(raw)
        return None if base is None else copy.copy(base)


def _departures(values: list[int], predicted: list[int]) -> tuple[list[int], list[int]]:
    if values == predicted:
        return [], []
    at = [i for i, (v, p) in enumerate(zip(values, predicted, strict=True)) if v != p]
    return at, [values[i] for i in at]


def _with(values: list[int], at: list[int], to: list[int]) -> list[int]:
    for i, v in zip(at, to, strict=True):
        values[i] = v
    return values


def _rare(so: Any, c: Any) -> dict[str, Any]:
    rare = {f: v for f in RARE if (v := getattr(so, f))}
    if so.preempted_req_ids is not None:
        rare["preempted_req_ids"] = list(so.preempted_req_ids)
    if c.new_token_ids:
        rare["new_token_ids"] = c.new_token_ids
    if c.all_token_ids:
        rare["all_token_ids"] = c.all_token_ids
    return rare


def _sampling_params(raw: bytes) -> Any:
    """SamplingParams from msgpack, ints kept where the sender had them (msgspec would
    make them floats); None for nil."""
    from vllm.sampling_params import SamplingParams

    plain = msgspec.msgpack.decode(raw)
    if plain is None:
        return None
    params = msgspec.msgpack.decode(raw, type=SamplingParams)
    for k, v in plain.items():
        if type(v) is int and type(getattr(params, k, None)) is float:
            setattr(params, k, v)
    return params
