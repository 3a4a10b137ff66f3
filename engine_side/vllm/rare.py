"""The rare fields of a vLLM SchedulerOutput: what a plain step leaves empty.

A step whose rare fields hold their plain values -- nothing joins, leaves or resumes,
no encoder inputs, no connector metadata, no KV copies -- is a candidate for the
same-batch, finish and turnover paths (:mod:`engine_side.vllm.quick`,
:mod:`.finish`, :mod:`.turnover`); any other takes the general path.  One list of
them, in one order, for the Python checks and the C ones (``rare_equal``).
"""

from __future__ import annotations

import sys
from operator import attrgetter
from typing import Any

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
