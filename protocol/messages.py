"""The wire vocabulary: msgspec Structs, tagged with small integers that never change.

Every message is an ``array_like`` Struct ``[tag, epoch, seq, ...]``.  Bulky or
optional content lives in a *body* Struct encoded as a msgpack map with
one- or two-letter keys and ``omit_defaults``: an absent field costs nothing, so
a steady decode step is a header and an empty map.

Integer arrays (handles, tokens, block ids, counts) are ``bytes`` holding
:mod:`protocol.packing` bit-packed arrays.  Schema evolution follows msgspec's
rules: new fields are appended last with defaults, tags and short keys are never
reused.  Because ``array_like`` decoders silently drop unknown trailing fields,
compatibility is decided by :class:`Hello` negotiation, never assumed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.params import LoRASpec, MMFeatureRef, PoolingSpec, SamplingSpec

PROTOCOL_MAJOR = 2  # 2: the schedule digest term is linear in the counts (SPEC §12)
PROTOCOL_MINOR = 0

# Feature bits offered in Hello.  A bit, once assigned, keeps its meaning.
FEATURE_ENGINE_TOKENS = 1 << 0  # engine-sent output tokens
FEATURE_TENSOR_FRAMES = 1 << 1  # tensors as extra frames
FEATURE_PREFIX_REFS = 1 << 2  # prompts referencing live prompts
FEATURE_SHM_STORE = 1 << 3  # multimodal items in a shared-memory store
SUPPORTED_FEATURES = FEATURE_ENGINE_TOKENS | FEATURE_TENSOR_FRAMES | FEATURE_PREFIX_REFS

TOKEN_MODE_WORKER = 0  # workers sample and keep their own tokens (vLLM v1 TP)
TOKEN_MODE_ENGINE = 1  # the engine sends every appended token (v0, PP)


class _Body(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Base of the sparse map-encoded parts of messages."""


class NewRequest(_Body, frozen=True):
    """A request entering the replicated state under ``handle``.

    The prompt is ``prefix`` tokens of live request ``prefix_handle``'s prompt
    followed by ``prompt`` (packed).  ``prompt_none`` marks a request without
    token ids (prompt embeddings only).  An add whose handle is live replaces
    that entry (an update).
    """

    handle: int = msgspec.field(name="h")
    req_id: str = msgspec.field(name="i")
    prompt: bytes = msgspec.field(default=b"", name="p")
    prefix_handle: int = msgspec.field(default=-1, name="ph")
    prefix: int = msgspec.field(default=0, name="pl")
    prompt_none: bool = msgspec.field(default=False, name="pn")
    sampling: SamplingSpec | None = msgspec.field(default=None, name="s")
    pooling: PoolingSpec | None = msgspec.field(default=None, name="po")
    lora: LoRASpec | None = msgspec.field(default=None, name="l")
    mm_features: tuple[MMFeatureRef, ...] = msgspec.field(default=(), name="m")
    prompt_embeds: Any = msgspec.field(default=None, name="e")
    prompt_is_token_ids: tuple[bool, ...] | None = msgspec.field(default=None, name="pt")
    num_computed: int = msgspec.field(default=0, name="c")
    output: bytes = msgspec.field(default=b"", name="o")


class Rows(_Body, frozen=True):
    """Per-row integer lists: ``handles`` (or schedule positions), ``counts``, flat ``values``.

    ``handles`` empty means "the scheduled requests, in batch order";
    ``counts`` empty means "one value per row".
    """

    handles: bytes = msgspec.field(default=b"", name="h")
    counts: bytes = msgspec.field(default=b"", name="n")
    values: bytes = msgspec.field(default=b"", name="v")


class DeltaBody(_Body, frozen=True):
    """What changed in one step, in application order (SPEC.md §8)."""

    finished: bytes = msgspec.field(default=b"", name="f")
    finished_unknown: tuple[str, ...] = msgspec.field(default=(), name="fx")
    added: tuple[NewRequest, ...] = msgspec.field(default=(), name="a")
    schedule_full: bytes = msgspec.field(default=b"", name="sf")
    schedule_drop: bytes = msgspec.field(default=b"", name="sd")
    schedule_append: bytes = msgspec.field(default=b"", name="sa")
    scheduled_tokens: Rows | None = msgspec.field(default=None, name="nt")
    computed_tokens: Rows | None = msgspec.field(default=None, name="nc")
    block_replace: tuple[Rows, ...] = msgspec.field(default=(), name="br")
    block_append: tuple[Rows, ...] = msgspec.field(default=(), name="ba")
    truncate: Rows | None = msgspec.field(default=None, name="tr")
    tokens: Rows | None = msgspec.field(default=None, name="ot")
    spec_tokens: Rows | None = msgspec.field(default=None, name="sp")
    encoder_inputs: Rows | None = msgspec.field(default=None, name="ei")
    preempted: bytes = msgspec.field(default=b"", name="pe")
    resumed: bytes = msgspec.field(default=b"", name="rs")
    free_encoder_mm_hashes: tuple[str, ...] = msgspec.field(default=(), name="fm")
    blocks_to_zero: bytes = msgspec.field(default=b"", name="bz")
    has_structured_output: bool = msgspec.field(default=False, name="so")
    pending_structured_output: bool = msgspec.field(default=False, name="ps")
    num_spec_tokens_to_schedule: int = msgspec.field(default=0, name="ns")
    extension: dict[str, bytes] = msgspec.field(default_factory=dict, name="x")


class SnapshotBody(_Body, frozen=True):
    """The whole replicated state (SPEC.md §6.2): live requests in handle order."""

    token_mode: int = msgspec.field(default=TOKEN_MODE_WORKER, name="tm")
    kv_groups: int = msgspec.field(default=1, name="kg")
    requests: tuple[NewRequest, ...] = msgspec.field(default=(), name="r")
    blocks: tuple[Rows, ...] = msgspec.field(default=(), name="b")
    schedule: bytes = msgspec.field(default=b"", name="s")
    scheduled_tokens: bytes = msgspec.field(default=b"", name="nt")


class Message(msgspec.Struct, frozen=True, array_like=True, gc=False, tag=True):
    """Common header: every message carries ``epoch`` and ``seq``."""

    epoch: int
    seq: int


class Hello(Message, frozen=True, tag=1):
    """First message of a session in either direction: version and features."""

    major: int = PROTOCOL_MAJOR
    minor: int = PROTOCOL_MINOR
    features: int = SUPPORTED_FEATURES
    role: str = ""
    rank: int = -1


class Goodbye(Message, frozen=True, tag=2):
    """Orderly end of a session; ``seq`` is the last seq the sender published/applied."""

    reason: str = ""


class Heartbeat(Message, frozen=True, tag=3):
    """Engine liveness; ``seq`` is the newest delta seq published (gap detection when idle)."""

    digest: int = 0


class Delta(Message, frozen=True, tag=4):
    """One step's changes.  Its base is ``seq - 1``; ``digest`` is the state after applying."""

    digest: int
    body: DeltaBody = DeltaBody()


class Snapshot(Message, frozen=True, tag=5):
    """The whole state at ``seq``; deltas with a seq above it follow."""

    digest: int
    body: SnapshotBody = SnapshotBody()


class CheckIn(Message, frozen=True, tag=6):
    """Worker → engine: liveness, applied ``seq`` and a lagged hash of its sampled tokens."""

    rank: int = 0
    state: str = ""
    token_hash: int = 0
    token_hash_seq: int = -1
    pid: int = 0


class SnapshotRequest(Message, frozen=True, tag=7):
    """Worker → engine: please send a Snapshot (``seq`` = the worker's applied seq or -1)."""

    rank: int = 0


AnyMessage = Hello | Goodbye | Heartbeat | Delta | Snapshot | CheckIn | SnapshotRequest
MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello, Goodbye, Heartbeat, Delta, Snapshot, CheckIn, SnapshotRequest,
)
