"""Worker side of the replies: a ``ModelRunnerOutput`` as a typed reply message
(the engine's :mod:`engine_side.vllm.replies` reads it back).

Request ids travel as positions in the batch of the step the reply answers; tokens,
logprobs and KV transfer lists are typed; connector outputs and other arbitrary
objects travel sealed (HMAC-authenticated pickle), never as unauthenticated pickle.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from protocol.ext import KVOutputWire, LogprobsWire, RefTable, ReplyMsg
from protocol.kernels import single_items
from protocol.packing import pack_sints, pack_uints
from protocol.seal import ChannelSeals


def reply_msg(out: Any, batch: list[str], seq: int, seals: ChannelSeals) -> ReplyMsg:
    """The reply message of ModelRunnerOutput ``out`` answering step ``seq`` of ``batch``:
    request ids as positions in the batch (or names the engine learns from the reply),
    one token per request as the whole message in the common step, logprobs and the
    rest typed, connector outputs sealed by ``seals`` (HMAC-authenticated pickle)."""
    ids = RefTable(batch, [])
    fields: dict[str, Any] = {}
    if out.req_ids != batch:
        fields["positions"] = ids.pack(out.req_ids)
    index = out.req_id_to_index
    if list(index) != out.req_ids or list(index.values()) != list(range(len(index))):
        # (ref, index) pairs, flat
        pairs = zip(ids.refs(list(index)), index.values(), strict=True)
        fields["index_map"] = pack_uints(list(chain.from_iterable(pairs)))
    sampled = out.sampled_token_ids
    # one token per request (the common step): the tokens are the whole message
    flat = single_items(sampled) if len(sampled) == len(out.req_ids) else None
    if flat is None:
        counts = list(map(len, sampled))
        if len(sampled) != len(out.req_ids) or counts.count(1) != len(counts):
            fields["counts"] = pack_uints(counts)
        flat = list(chain.from_iterable(sampled))
    if flat:
        fields["tokens"] = pack_sints(flat)
    if out.logprobs is not None:
        fields["logprobs"] = LogprobsWire(*out.logprobs)
    if out.prompt_logprobs_dict:
        fields["prompt_lp"] = tuple((ids.ref(k), None if v is None else LogprobsWire(*v))
                                    for k, v in out.prompt_logprobs_dict.items())
    if out.prompt_token_id_logprobs_dict:
        fields["prompt_tid"] = ids.pairs(out.prompt_token_id_logprobs_dict)
    if out.num_nans_in_logits is not None:
        fields["nans"] = ids.pairs(out.num_nans_in_logits)
    if out.sampling_masks is not None:
        fields["masks"] = tuple(out.sampling_masks)
    fields.update(_opaque(out, seals))
    return ReplyMsg(seq=seq, names=tuple(ids.names), pooler=out.pooler_output, **fields)

def _opaque(out: Any, seals: ChannelSeals) -> dict[str, Any]:
    """The reply fields of ``out``'s connector outputs: KV transfer lists typed, the rest
    sealed by ``seals``."""
    if out.kv_connector_output is None and out.ec_connector_output is None and \
            out.cudagraph_stats is None and out.aux_output_connector_output is None:
        return {}  # the common reply: no connector output
    opaque: dict[str, Any] = {}
    fields: dict[str, Any] = {}
    kv = out.kv_connector_output
    if kv is not None:
        fields["kv"] = KVOutputWire(
            sending=None if kv.finished_sending is None else sorted(kv.finished_sending),
            recving=None if kv.finished_recving is None else sorted(kv.finished_recving),
            invalid_blocks=sorted(kv.invalid_block_ids), failed=sorted(kv.failed_recving),
            expected=kv.expected_finished_count)
        parts = {"stats": kv.kv_connector_stats, "events": kv.kv_cache_events,
                 "meta": kv.kv_connector_worker_meta}
        parts = {k: v for k, v in parts.items() if v is not None}
        if parts:
            opaque["kv"] = parts
    for key, value in (("ec", out.ec_connector_output), ("cudagraph", out.cudagraph_stats),
                       ("aux", out.aux_output_connector_output)):
        if value is not None:
            opaque[key] = value
    if opaque:
        fields["sealed"] = seals.seal(opaque)
    return fields
