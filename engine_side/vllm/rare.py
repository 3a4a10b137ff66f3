"""The rare fields of a vLLM SchedulerOutput: what a plain step leaves empty.

A step whose rare fields hold their plain values -- nothing joins, leaves or resumes,
no encoder inputs, no connector metadata, no KV copies -- is a candidate for the
same-batch, finish and turnover paths (:mod:`engine_side.vllm.quick`,
:mod:`.finish`, :mod:`.turnover`); any other takes the general path.  One list of
them, in one order, for the Python checks and the C ones (``rare_equal``); and
:func:`step_ext`, which writes those that depart from the decoder's prediction into
the general path's extension.
"""

from __future__ import annotations

import sys
from operator import attrgetter
from typing import Any

from engine_side.vllm.convert import ChannelSeals
from protocol.errors import LocalProtocolError
from protocol.packing import pack_uints

#: Connector metadata fields (arbitrary objects set by KV/EC connectors): the general
#: path seals them into the extension slot.
CONNECTOR_FIELDS = ("kv_connector_metadata", "ec_connector_metadata",
                    "aux_output_connector_metadata", "ec_manager_metadata")

#: A plain step's rare fields and their values in a plain step, in the order
#: :func:`plain_fields` reads them; the first three are the step's joins and leaves (the
#: turnover path, engine_side.vllm.turnover, takes those and checks the rest).
RARE_FIELDS: tuple[tuple[str, Any], ...] = (
    ("scheduled_new_reqs", []), ("finished_req_ids", set()), ("preempted_req_ids", set()),
    ("free_encoder_mm_hashes", []), ("scheduled_encoder_inputs", {}),
    ("scheduled_encoder_input_stats", None), ("num_invalid_spec_tokens", None),
    ("has_sync_kv_loads", False), ("new_block_ids_to_zero", None),
    ("kv_cache_block_copies", None), ("num_common_prefix_blocks", []),
    ("kv_connector_block_state", None), *((f, None) for f in CONNECTOR_FIELDS),
    ("scheduled_cached_reqs.resumed_req_ids", set()),
    ("scheduled_cached_reqs.new_token_ids", []), ("scheduled_cached_reqs.all_token_ids", {}))
JOINS_AND_LEAVES = 3  # RARE_FIELDS[:3]

#: A plain step's rare fields, read by one C call, and their values in a plain step
#: (compared with one tuple).
RARE = attrgetter(*(name for name, _ in RARE_FIELDS))
PLAIN: tuple[Any, ...] = tuple(value for _, value in RARE_FIELDS)
#: The rare fields by name, as the C checks read them (``rare_equal``: one at a time,
#: until one differs, no tuple made): an attribute of the step, or (attribute, its
#: attribute); interned, as attribute names are.
RARE_NAMES: tuple[str | tuple[str, ...], ...] = tuple(
    tuple(map(sys.intern, name.split("."))) if "." in name else sys.intern(name)
    for name, _ in RARE_FIELDS)


def read_rare(so: Any, rare: Any) -> tuple[Any, ...]:
    """The rare fields of ``so`` that ``rare`` names (:data:`RARE_NAMES`' form), or
    ``rare(so)`` for a callable (:data:`RARE`)."""
    if not isinstance(rare, tuple):
        return rare(so)  # type: ignore[no-any-return]
    return tuple(getattr(getattr(so, name[0]), name[1]) if isinstance(name, tuple)
                 else getattr(so, name) for name in rare)


def plain_fields(so: Any) -> bool:
    """No request enters, leaves or resumes, and no rare field is set."""
    rare = RARE(so)
    if rare == PLAIN:
        return True
    # the same up to container types (a test may hand in a tuple or a dict for a set)
    return (not rare[0] and not rare[1] and rare[2] is not None and not rare[2]
            and not rare[3] and not rare[4] and rare[5] is None and rare[6] is None
            and not rare[7] and rare[8] is None and rare[9] is None and rare[10] == []
            and all(v is None for v in rare[11:12 + len(CONNECTOR_FIELDS)])
            and not any(rare[-3:]))


def step_ext(so: Any, batch: list[str], pos: dict[str, int], ext: dict[str, Any],
             seals: ChannelSeals) -> None:
    """The general path's extension entries (``ext``) for a step's rare fields that
    depart from what the decoder predicts (batch-keyed dicts out of batch order, a total
    that is not the counts' sum, None for empty or empty for None, encoder stats,
    invalid drafts, KV copies and loads, common prefix blocks) and its connector metadata
    sealed by ``seals`` (HMAC-authenticated pickle, label ``b"step"``).  Raises
    LocalProtocolError for a field that must not leave the scheduler, or that names an
    unscheduled request."""
    for name, d in (("spec_keys", so.scheduled_spec_decode_tokens),
                    ("enc_keys", so.scheduled_encoder_inputs)):
        keys = _dict_keys(d, batch, pos)
        if keys is not None:
            ext[name] = keys
    if so.total_num_scheduled_tokens != sum(so.num_scheduled_tokens.values()):
        ext["total"] = so.total_num_scheduled_tokens
    if so.preempted_req_ids is None:
        ext["preempted_none"] = True
    if so.new_block_ids_to_zero == []:
        ext["zero_empty"] = True
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
    opaque = {f: getattr(so, f) for f in CONNECTOR_FIELDS if getattr(so, f) is not None}
    if opaque:
        ext["sealed"] = seals.seal(opaque)


def _dict_keys(d: dict[str, Any], batch: list[str], pos: dict[str, int]) -> bytes | None:
    """None when ``d``'s keys are the batch ids with non-empty values, in batch order."""
    if not d:
        return None
    predicted = [rid for rid in batch if d.get(rid)]
    if list(d) == predicted:
        return None
    unknown = [k for k in d if k not in pos]
    if unknown:
        raise LocalProtocolError("a per-request field names an unscheduled request",
                                 req_ids=unknown[:8])
    return pack_uints([pos[k] for k in d])
