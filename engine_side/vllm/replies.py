"""Engine side of the reply path: a worker's ``ModelRunnerOutput`` frames back to vLLM's.

A :class:`~engine_side.vllm.schema.ReplyMsg` names requests by reference into the
batch of the step it answers (``batches``: the encoder's batch per recent step), so
the request ids never travel; see SPEC §16 for the fields and the refusals.

Contract: every call returns fresh objects (vLLM's engine may edit what it gets);
nothing from a reply frame is unpickled unless sealed with the run's secret (label
``b"reply"``, :mod:`protocol.seal`).
"""

from __future__ import annotations

import functools
from itertools import accumulate
from typing import Any

import msgspec

from protocol import codec
from protocol.errors import MalformedMessage, RemoteProtocolError
from protocol.ext import LogprobsWire, RefTable, ReplyMsg, decode_frames
from protocol.kernels import singletons
from protocol.packing import unpack_sint_list, unpack_uint_list
from protocol.seal import ChannelSeals

#: single-frame replies (the common ones): a tensor reference is malformed, so one shared
#: decoder serves them (the others need a hook over their own frames)
_REPLY = msgspec.msgpack.Decoder(ReplyMsg, ext_hook=codec.no_tensor_frames)


def _logprobs(w: LogprobsWire | None, tensors: bool) -> Any:
    if w is None:
        return None
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    if tensors:
        return LogprobsTensors(w.token_ids, w.logprobs, w.ranks, w.cu, w.cu_tensor)
    return LogprobsLists(w.token_ids, w.logprobs, w.ranks, w.cu)


def _kv_output(msg: ReplyMsg, ids: RefTable, opaque: dict[str, Any]) -> Any:
    w = msg.kv
    if w is None:
        return None
    from vllm.v1.outputs import KVConnectorOutput

    kv = opaque.get("kv", {})
    return KVConnectorOutput(
        finished_sending=None if w.sending is None else set(w.sending),
        finished_recving=None if w.recving is None else set(w.recving),
        kv_connector_stats=kv.get("stats"), kv_cache_events=kv.get("events"),
        kv_connector_worker_meta=kv.get("meta"),
        invalid_block_ids=set(w.invalid_blocks), failed_recving=set(w.failed),
        expected_finished_count=w.expected)


@functools.cache
def _output_types() -> tuple[Any, Any]:
    """vLLM's ModelRunnerOutput and SamplingMaskLists, imported once (an import statement
    costs ~1 µs a reply)."""
    from vllm.v1.outputs import ModelRunnerOutput, SamplingMaskLists

    return ModelRunnerOutput, SamplingMaskLists


class IndexCache:
    """The req_id_to_index of the last batch replied to, copied for each reply (a dict
    copy costs a fraction of building it); keyed by the batch list's identity (the
    encoder's own lists, never changed once stored)."""

    def __init__(self) -> None:
        self.batch: list[str] | None = None
        self.index: dict[str, int] = {}

    def positions(self, batch: list[str]) -> dict[str, int]:
        if batch is not self.batch:
            self.batch, self.index = batch, dict(zip(batch, range(len(batch)), strict=True))
        return dict(self.index)


def decode_reply(frames: list[Any], batches: dict[int, list[str]], seals: ChannelSeals,
                 cache: IndexCache | None = None) -> Any:
    """ModelRunnerOutput (or None) from a worker's reply frames (``seals`` opens its
    sealed connector outputs)."""
    ModelRunnerOutput, SamplingMaskLists = _output_types()  # noqa: N806 - classes

    msg = decode_frames(frames, _REPLY, ReplyMsg, "reply")
    if msg.none:
        return None
    if msg.seq not in batches:
        raise RemoteProtocolError("reply refers to an unknown step", seq=msg.seq)
    ids = RefTable(batches[msg.seq], list(msg.names))
    req_ids = list(batches[msg.seq]) if not msg.positions else ids.resolve(msg.positions)
    if msg.index_map is None:
        index = dict(zip(req_ids, range(len(req_ids)), strict=True)) if msg.positions or \
            cache is None else cache.positions(batches[msg.seq])
    else:
        flat = unpack_uint_list(msg.index_map)  # (ref, index) pairs
        if len(flat) % 2:
            raise MalformedMessage("reply index map is not (ref, index) pairs", items=len(flat))
        index = dict(zip(ids.names_of(flat[0::2]), flat[1::2], strict=True))
        if max(flat[1::2], default=0) >= max(len(req_ids), 1):
            raise MalformedMessage("reply index past its requests", requests=len(req_ids))
    flat_tokens = unpack_sint_list(msg.tokens) if msg.tokens else []
    if not msg.counts:  # one token per request
        if len(flat_tokens) != len(req_ids):
            raise MalformedMessage("reply tokens are not one per request",
                                   tokens=len(flat_tokens), requests=len(req_ids))
        sampled = singletons(flat_tokens)
    else:
        offsets = [0, *accumulate(unpack_uint_list(msg.counts))]
        if offsets[-1] != len(flat_tokens):
            raise MalformedMessage("reply token counts do not add up to its tokens",
                                   counted=offsets[-1], tokens=len(flat_tokens))
        if len(offsets) - 1 not in (0, len(req_ids)):  # (none: a pooling model's reply)
            raise MalformedMessage("reply token lists are not one per request",
                                   lists=len(offsets) - 1, requests=len(req_ids))
        sampled = [flat_tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
    if not (msg.sealed or msg.prompt_lp or msg.prompt_tid or msg.nans) and \
            msg.logprobs is None and msg.pooler is None and msg.kv is None and msg.masks is None:
        # the common reply: every other field at its default, as the full call sets it
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index=index,
                                 sampled_token_ids=sampled,
                                 num_nans_in_logits=None if msg.nans is None else {})
    opaque = seals.open(msg.sealed)
    masks = None if msg.masks is None else SamplingMaskLists(*msg.masks)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index=index, sampled_token_ids=sampled,
        logprobs=_logprobs(msg.logprobs, tensors=False),
        prompt_logprobs_dict={ids.name(k): _logprobs(v, True) for k, v in msg.prompt_lp},
        prompt_token_id_logprobs_dict=ids.named(msg.prompt_tid),
        pooler_output=msg.pooler, kv_connector_output=_kv_output(msg, ids, opaque),
        ec_connector_output=opaque.get("ec"),
        num_nans_in_logits=None if msg.nans is None else ids.named(msg.nans),
        cudagraph_stats=opaque.get("cudagraph"),
        aux_output_connector_output=opaque.get("aux"), sampling_masks=masks)
