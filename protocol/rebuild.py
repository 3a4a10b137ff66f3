"""Whole requests ⇄ the replicated state: the reference engine's view, and the tests' oracle.

:func:`wire_spec` and :func:`request_spec` convert a :class:`RequestSpec` (the full
request's static data) to the wire's :class:`Spec` plus the tensors that travel
beside it, and back.  :func:`rebuild_request` makes the whole
:class:`ExecuteModelRequest` of the step just applied, from a state that keeps its
tables: O(scheduled requests and their blocks), fresh containers, token views that
never change once handed out.  Receivers that run vLLM never call it: they build their
step objects from the :class:`Applied` record instead.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from protocol.errors import DECODE_ERRORS, LocalProtocolError, MalformedMessage, malformed
from protocol.messages import TOKEN_MODE_ENGINE, DeltaBody, MMItem, NewRequest, Rows, Spec
from protocol.packing import pack_uints, unpack_uints
from protocol.params import MMFeatureRef
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
from protocol.state import Applied, ReplicaState, RowSet

_EXT_DECODER = msgspec.msgpack.Decoder(dict[str, bytes])


def decode_extension(body: DeltaBody) -> dict[str, bytes]:
    """The reference profile's extension of ``body`` (§6.4): a map str → bin, or empty.
    MalformedMessage for bytes that are not one (a receiver checks it before the step
    applies: :class:`worker_side.replica.WorkerReplica`'s ``check``)."""
    try:
        return _EXT_DECODER.decode(body.extension) if body.extension else {}
    except DECODE_ERRORS as exc:
        raise malformed("the extension slot does not decode", exc) from exc


def wire_spec(spec: RequestSpec) -> tuple[Spec, tuple[Any, ...], tuple[Any, ...], Any]:
    """(the wire spec, each item's data, each item's placeholder mask, the prompt embeds)."""
    prompt, embeds = spec.prompt_token_ids, spec.prompt_embeds
    features = spec.mm_features
    wire = Spec(req_id=spec.req_id, prompt=b"" if prompt is None else pack_uints(prompt),
                prompt_none=prompt is None, sampling=spec.sampling, pooling=spec.pooling,
                lora=spec.lora,
                mm=tuple(MMItem(f.modality, f.identifier, f.offset, f.length, f.mm_hash)
                         for f in features),
                prompt_is_token_ids=spec.prompt_is_token_ids,
                embeds=None if embeds is None else (str(embeds.dtype), tuple(embeds.shape)))
    data = tuple(f.data for f in features) if any(f.data is not None for f in features) else ()
    masks = tuple(f.is_embed for f in features) \
        if any(f.is_embed is not None for f in features) else ()
    return wire, data, masks, embeds


def request_spec(spec: Spec, new: NewRequest) -> RequestSpec:
    """The RequestSpec of a wire spec and what travelled beside it."""
    n = len(spec.mm)
    data = new.mm_data or (None,) * n
    masks = new.mm_embed or (None,) * n
    if len(data) != n or len(masks) != n:
        raise MalformedMessage("item data does not match the spec's items", req_id=spec.req_id)
    prompt = None
    if not spec.prompt_none:
        prompt = unpack_uints(spec.prompt) if spec.prompt else np.zeros(0, dtype=np.int64)
        prompt.flags.writeable = False
    return RequestSpec(
        req_id=spec.req_id, prompt_token_ids=prompt, sampling=spec.sampling,
        pooling=spec.pooling, lora=spec.lora,
        mm_features=tuple(MMFeatureRef(m.modality, m.identifier, m.offset, m.length, m.mm_hash,
                                       d, e) for m, d, e in zip(spec.mm, data, masks,
                                                                strict=True)),
        prompt_embeds=new.embeds, prompt_is_token_ids=spec.prompt_is_token_ids)


def _ragged(rows: RowSet | None, n: int, shift: int = 0) -> Ragged:
    """Rows keyed by schedule position as one list per position (empty where absent)."""
    if rows is None:
        return Ragged(np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64))
    chunks: list[list[int]] = [[] for _ in range(n)]
    at = 0
    for p, c in zip(rows.keys, rows.counts, strict=True):
        chunks[p] = [v - shift for v in rows.values[at:at + c]]
        at += c
    return Ragged.from_lists(chunks)


def rebuild_request(state: ReplicaState, body: DeltaBody, applied: Applied,
                    cache: dict[int, tuple[NewRequest, RequestSpec]]) -> ExecuteModelRequest:
    """The whole request of the step ``body`` just made (``cache``: the caller's
    RequestSpecs by handle, each valid while the handle holds the same added request)."""
    tables = state.tables
    if tables is None:
        raise LocalProtocolError("rebuilding a request needs a state that keeps its tables")
    sched: list[int] = state.schedule.tolist()
    specs: dict[int, RequestSpec] = {}
    for h in sched:
        new = state.requests[h]
        held = cache.get(h)
        if new is None:
            raise LocalProtocolError("a scheduled handle is not live", handle=h)
        if held is None or held[0] is not new:
            held = cache[h] = (new, request_spec(state.spec_of(h), new))
        specs[h] = held[1]
    n = len(sched)
    rare = body.rare
    ids = [specs[h].req_id for h in sched]
    engine = state.token_mode == TOKEN_MODE_ENGINE
    names = lambda hs: frozenset(state.spec_of(h).req_id for h in hs)  # noqa: E731
    return ExecuteModelRequest(
        req_ids=ids, specs=[specs[h] for h in sched],
        num_scheduled_tokens=state.nsched.copy(),
        num_computed_tokens=state.cols.computed[state.schedule],
        block_tables=tuple(Ragged(*t.gather(state.schedule)) for t in tables),
        spec_token_ids=_ragged(applied.spec_rows, n, 1),
        encoder_inputs=_ragged(applied.encoder_rows, n),
        output_token_ids=[state.token_history(h) for h in sched] if engine else None,
        finished_req_ids=frozenset(applied.finished_ids),
        preempted_req_ids=names(applied.preempted), resumed_req_ids=names(applied.resumed),
        free_encoder_mm_hashes=rare.free_encoder_mm_hashes,
        blocks_to_zero=None if applied.zero is None else np.asarray(applied.zero,
                                                                    dtype=np.int64),
        has_structured_output_requests=body.has_structured_output,
        pending_structured_output_tokens=body.pending_structured_output,
        num_spec_tokens_to_schedule=rare.num_spec_tokens_to_schedule,
        extension=decode_extension(body))


def ragged_rows(r: Ragged, shift: int = 0) -> Rows | None:
    """A Ragged aligned with the schedule as Rows keyed by the positions it fills."""
    lengths: list[int] = r.lengths.tolist()
    keys = [p for p, c in enumerate(lengths) if c]
    if not keys:
        return None
    counts = [lengths[p] for p in keys]
    values: Any = r.values + shift if shift else r.values
    return Rows(keys=pack_uints(keys), counts=b"" if counts.count(1) == len(counts)
                else pack_uints(counts), values=pack_uints(values))
