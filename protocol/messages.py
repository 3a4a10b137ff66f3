"""The wire vocabulary: msgspec Structs, tagged with small integers that never change.

Every message is an ``array_like`` Struct ``[tag, epoch, seq, ...]``.  Bulky or
optional content lives in a *body* Struct encoded as a msgpack map with one- or
two-letter keys and ``omit_defaults``: an absent field costs nothing, so a steady
decode step is a header and an empty map.  A DeltaBody has fewer than 16 fields
(the rare ones sit in :class:`RareBody`), so its map header is one byte.

Integer arrays (handles, positions, tokens, block ids, counts) are ``bytes`` holding
:mod:`protocol.packing` bit-packed arrays.  A request's static data (:class:`Spec`)
travels as its own msgpack bytes (``msgspec.Raw`` inside :class:`NewRequest`): the
digest hashes exactly those bytes, so no end re-encodes a spec to hash it.
Schema evolution follows msgspec's rules: new fields are appended last with
defaults, tags and short keys are never reused; compatibility is decided by
:class:`Hello` negotiation (the major version), never assumed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.params import LoRASpec, PoolingSpec, SamplingSpec

PROTOCOL_MAJOR = 3  # 3: rows by schedule position, specs hashed as sent (SPEC §12)
PROTOCOL_MINOR = 0

# Feature bits offered in Hello.  A bit, once assigned, keeps its meaning.
FEATURE_ENGINE_TOKENS = 1 << 0  # engine-sent output tokens
FEATURE_TENSOR_FRAMES = 1 << 1  # tensors as extra frames
FEATURE_SHM_STORE = 1 << 3  # multimodal items in a shared-memory store (bit 2 retired)
SUPPORTED_FEATURES = FEATURE_ENGINE_TOKENS | FEATURE_TENSOR_FRAMES

TOKEN_MODE_WORKER = 0  # workers sample and keep their own tokens (vLLM TP)
TOKEN_MODE_ENGINE = 1  # the engine sends every appended token (the reference engine)

MAX_HANDLE = 1 << 24  # handles are 0 ..= MAX_HANDLE
MAX_BLOCK_ID = (1 << 31) - 1  # block ids fit int32
MAX_COUNT = (1 << 62) - 1  # computed and scheduled counts: far from int64's end


class _Body(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """Base of the sparse map-encoded parts of messages."""


class MMItem(_Body, frozen=True):
    """The static description of one multimodal item of a request (its data travels
    beside the spec, in :attr:`NewRequest.mm_data`, and is not hashed)."""

    modality: str = msgspec.field(name="k")
    identifier: str = msgspec.field(name="i")
    offset: int = msgspec.field(name="o")
    length: int = msgspec.field(name="n")
    mm_hash: str | None = msgspec.field(default=None, name="h")


class Spec(_Body, frozen=True):
    """What is fixed for a request's lifetime; its encoded bytes cross the wire once.

    ``prompt`` is packed (absent with ``prompt_none``: prompt embeddings only);
    ``embeds`` names the prompt embeddings' dtype and shape when the request has them.
    """

    req_id: str = msgspec.field(name="i")
    prompt: bytes = msgspec.field(default=b"", name="p")
    prompt_none: bool = msgspec.field(default=False, name="pn")
    sampling: SamplingSpec | None = msgspec.field(default=None, name="s")
    pooling: PoolingSpec | None = msgspec.field(default=None, name="po")
    lora: LoRASpec | None = msgspec.field(default=None, name="l")
    mm: tuple[MMItem, ...] = msgspec.field(default=(), name="m")
    prompt_is_token_ids: tuple[bool, ...] | None = msgspec.field(default=None, name="pt")
    embeds: tuple[str, tuple[int, ...]] | None = msgspec.field(default=None, name="e")


class NewRequest(_Body, frozen=True):
    """A request entering the replicated state under ``handle`` (an add whose handle is
    live replaces that entry).  ``spec`` is an encoded :class:`Spec`; ``mm_data``
    (one entry per spec item, or empty) and ``mm_embed`` hold its items' data and
    placeholder masks, ``embeds`` its prompt embeddings (tensors; not hashed)."""

    handle: int = msgspec.field(name="h")
    spec: msgspec.Raw = msgspec.field(name="s")
    computed: int = msgspec.field(default=0, name="c")
    output: bytes = msgspec.field(default=b"", name="o")
    mm_data: tuple[Any, ...] = msgspec.field(default=(), name="d")
    mm_embed: tuple[Any, ...] = msgspec.field(default=(), name="m")
    embeds: Any = msgspec.field(default=None, name="e")


class Rows(_Body, frozen=True):
    """Per-row integer lists: row keys (``h``), values per row (``n``), flat values (``v``).

    In a Delta, ``h`` holds positions in the step's new schedule (absent: every
    position, in order) and ``n`` absent means one value per row.
    """

    keys: bytes = msgspec.field(default=b"", name="h")
    counts: bytes = msgspec.field(default=b"", name="n")
    values: bytes = msgspec.field(default=b"", name="v")


class RareBody(_Body, frozen=True):
    """The fields of a Delta that most steps leave empty."""

    finished_unknown: tuple[str, ...] = msgspec.field(default=(), name="fx")
    schedule_full: bytes = msgspec.field(default=b"", name="sf")
    block_replace: tuple[Rows, ...] = msgspec.field(default=(), name="br")
    truncate: Rows | None = msgspec.field(default=None, name="tr")
    encoder_inputs: Rows | None = msgspec.field(default=None, name="ei")
    preempted: bytes = msgspec.field(default=b"", name="pe")
    resumed: bytes = msgspec.field(default=b"", name="rs")
    free_encoder_mm_hashes: tuple[str, ...] = msgspec.field(default=(), name="fm")
    blocks_to_zero: bytes | None = msgspec.field(default=None, name="bz")
    num_spec_tokens_to_schedule: int = msgspec.field(default=0, name="ns")


NO_RARE = RareBody()


class DeltaBody(_Body, frozen=True):
    """What changed in one step, in application order (SPEC.md §8.3)."""

    finished: bytes = msgspec.field(default=b"", name="f")
    added: tuple[NewRequest, ...] = msgspec.field(default=(), name="a")
    schedule_drop: bytes = msgspec.field(default=b"", name="sd")
    schedule_append: bytes = msgspec.field(default=b"", name="sa")
    scheduled_tokens: Rows | None = msgspec.field(default=None, name="nt")
    computed_tokens: Rows | None = msgspec.field(default=None, name="nc")
    block_append: tuple[Rows, ...] = msgspec.field(default=(), name="ba")
    tokens: Rows | None = msgspec.field(default=None, name="ot")
    spec_tokens: Rows | None = msgspec.field(default=None, name="sp")
    has_structured_output: bool = msgspec.field(default=False, name="so")
    pending_structured_output: bool = msgspec.field(default=False, name="ps")
    rare: RareBody = msgspec.field(default=NO_RARE, name="r")
    extension: bytes = msgspec.field(default=b"", name="x")


EMPTY_BODY = DeltaBody()  # the steady decode step: the schedule repeats, nothing else


class SnapshotBody(_Body, frozen=True):
    """The whole replicated state (SPEC.md §6.2): live requests in handle order; block
    rows keyed by handle."""

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
    """First message of a session in either direction: version, features and, from a
    worker, the rank it speaks for; ``config`` a digest of what both ends must share
    (an executor's model configuration), ``version`` the peer software's version."""

    major: int = PROTOCOL_MAJOR
    minor: int = PROTOCOL_MINOR
    features: int = SUPPORTED_FEATURES
    role: str = ""
    rank: int = -1
    config: str = ""
    version: str = ""


class Goodbye(Message, frozen=True, tag=2):
    """Orderly end of a session; ``seq`` is the last seq the sender published/applied."""

    reason: str = ""


class Heartbeat(Message, frozen=True, tag=3):
    """Engine liveness; ``seq`` is the newest delta seq published (gap detection when idle)."""

    digest: int = 0


class Delta(Message, frozen=True, tag=4):
    """One step's changes.  Its base is ``seq - 1``; ``digest`` is the state after applying."""

    digest: int
    body: DeltaBody = EMPTY_BODY


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

_SPEC_ENCODER = msgspec.msgpack.Encoder()
_SPEC_DECODER = msgspec.msgpack.Decoder(Spec)


def encode_spec(spec: Spec) -> msgspec.Raw:
    """A spec's wire bytes (what :attr:`NewRequest.spec` carries and the digest hashes)."""
    return msgspec.Raw(_SPEC_ENCODER.encode(spec))


def decode_spec(raw: Any) -> Spec:
    """The :class:`Spec` of wire bytes; msgspec's errors for bad bytes (callers map
    them to MalformedMessage)."""
    return _SPEC_DECODER.decode(raw)
