"""Frames ⇄ messages.

``encode(msg)`` returns ``[body, *tensor_frames]``: frame 0 is the msgpack body,
every tensor (anywhere inside the message) follows as its own zero-copy frame.
"Bytes of a message" means the sum of its frame lengths.  ``decode(frames)``
accepts ``bytes``, ``memoryview`` or ``zmq.Frame`` objects and raises
:class:`MalformedMessage` -- and nothing else -- for any bad input.

Encoders and decoders are built once per thread (the tensor hook keeps per-call
scratch, so one encoder must not be shared across threads).  Messages that cannot
hold a tensor (a Delta that adds no request) and single-frame decodes use shared
hook-free codecs instead: no per-thread state to look up (the steady path's cost).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.errors import DECODE_ERRORS, MalformedMessage, ProtocolError, malformed
from protocol.messages import AnyMessage, Delta, DeltaBody, Message, Rows
from protocol.plan import STEADY_BODY
from protocol.speedups import C as _C
from protocol.tensors import make_enc_hook, make_ext_hook

Frame = bytes | memoryview
DEFAULT_MAX_FRAMES = 1 << 16

_local = threading.local()


def _encoder() -> tuple[msgspec.msgpack.Encoder, list[Any]]:
    enc = getattr(_local, "encoder", None)
    if enc is None:
        aux: list[Any] = []
        enc = (msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)), aux)
        _local.encoder = enc
    return enc  # type: ignore[no-any-return]


def encode(msg: Message) -> list[Frame]:
    """Encode ``msg`` to frames; tensor frames alias the sender's memory (SPEC §11)."""
    if type(msg) is Delta:
        if msg.body is STEADY_BODY:  # header ints and an empty map: [4, epoch, seq, digest, {}]
            return [_PLAIN_ENCODER.encode((4, msg.epoch, msg.seq, msg.digest, _EMPTY_MAP))]
        if not msg.body.added:  # only added requests hold tensors: no frame state needed
            try:
                return [compact_delta_map(_PLAIN_ENCODER.encode(msg))]
            except TypeError:
                pass  # something off-schema: the hooked encoder decides
        body, tensors = _encode(msg)
        return [compact_delta_map(body), *tensors]
    body, tensors = _encode(msg)
    return [body, *tensors]


def plain_delta_frame(epoch: int, seq: int, digest: int, rows: tuple[bytes, bytes, bytes],
                      structured: bool = False, pending: bool = False) -> bytes:
    """The frame -- the only one -- :func:`encode` writes for ``Delta(epoch, seq, digest,
    DeltaBody(block_append=(Rows(*rows),), has_structured_output=structured,
    pending_structured_output=pending))``: a plain step with one KV group's appends,
    written by one C call without making the objects (made and encoded without the
    speedups, or for values the C call does not take)."""
    if _C is not None:
        frame = _C.plain_delta(epoch, seq, digest, *rows, structured, pending)
        if frame is not None:
            return frame  # type: ignore[no-any-return]
    body = DeltaBody(block_append=(Rows(handles=rows[0], counts=rows[1], values=rows[2]),),
                     has_structured_output=structured, pending_structured_output=pending)
    return bytes(encode(Delta(epoch, seq, digest, body))[0])


def _encode(msg: Message) -> tuple[bytes, list[Frame]]:
    """Frame 0 and the tensor frames of ``msg``."""
    encoder, aux = _encoder()
    aux.clear()
    try:
        return encoder.encode(msg), list(aux)
    finally:
        aux.clear()


# msgpack int header byte -> bytes the int takes (fixints are 1; 0xcc..0xd3 carry a payload)
_LONG_INTS = {0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}
_INT_SIZE = bytes(_LONG_INTS.get(b, 1) for b in range(0x100))
COMPACT_LIMIT = 1024  # larger Delta frames keep msgspec's header: 2 bytes are noise there


def compact_delta_map(frame: bytes) -> bytes:
    """A Delta frame with its body map's header in the shortest form (SPEC §6.2).

    DeltaBody has more than 15 fields, so msgspec writes a map16 header (3 bytes)
    even for a body of 0..15 entries, where a fixmap (1 byte) says the same.  The
    body is the last element of the Delta array ``[4, epoch, seq, digest, body]``,
    after four msgpack ints.  Frames over :data:`COMPACT_LIMIT` bytes are returned
    as they are (the rewrite copies the frame)."""
    if len(frame) > COMPACT_LIMIT:
        return frame
    if _C is not None:
        return _C.compact_map(frame)  # type: ignore[no-any-return]
    at = _body_offset(frame)
    if at + 2 >= len(frame) or frame[at] != 0xDE or frame[at + 1] or frame[at + 2] > 15:
        return frame
    return frame[:at] + _FIXMAP[frame[at + 2]] + frame[at + 3:]


def _body_offset(frame: bytes) -> int:
    """Where a Delta frame's body map starts: past the fixarray header and four msgpack
    ints (tag, epoch, seq, digest); ``len(frame)`` or more when the frame ends first."""
    at = 1
    for _ in range(4):
        if at >= len(frame):
            break
        at += _INT_SIZE[frame[at]]
    return at


_FIXMAP = [bytes((0x80 | n,)) for n in range(16)]


def _as_buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def no_tensor_frames(code: int, data: memoryview) -> Any:
    """The ext hook of a single-frame message: any tensor reference is malformed."""
    raise MalformedMessage("message references a tensor frame it does not have", code=code)


_PLAIN_ENCODER = msgspec.msgpack.Encoder()  # stateless: shared by all threads
_EMPTY_MAP: dict[str, Any] = {}  # the steady Delta's body as a fixmap (never filled)
#: single-frame messages: a tensor reference is an error, so no per-thread frame state
_SINGLE_FRAME_DECODER = msgspec.msgpack.Decoder(AnyMessage, ext_hook=no_tensor_frames)


def _malformed(exc: Exception) -> MalformedMessage:
    return malformed("frames do not decode to a message", exc)


def _decode_body(body: Any, hook: Any) -> AnyMessage:
    _local.ext_hook = hook
    try:
        return _decoder().decode(body)
    except ProtocolError:
        raise
    except DECODE_ERRORS as exc:
        raise _malformed(exc) from exc
    finally:
        _local.ext_hook = None  # never keep a message's frames alive past its decode


def _ext_hook(code: int, data: memoryview) -> Any:
    """Resolve a tensor Ext against the frames of the decode in progress (thread-local)."""
    return _local.ext_hook(code, data)


def _decoder() -> msgspec.msgpack.Decoder[AnyMessage]:
    dec = getattr(_local, "decoder", None)
    if dec is None:
        dec = msgspec.msgpack.Decoder(AnyMessage, ext_hook=_ext_hook)
        _local.decoder = dec
    return dec


#: the DeltaBody fields of a plain step: block appends and the structured-output flags
PLAIN_BODY_FIELDS = ("block_append", "has_structured_output", "pending_structured_output")
#: frames longer than this are not tried as plain (a plain step's frame is a few dozen
#: bytes; the try costs a failed decode on any other)
PLAIN_FRAME_LIMIT = 256


def _plain_view() -> Any:
    """A Delta's wire shape whose body may carry :data:`PLAIN_BODY_FIELDS` alone: the
    same field names and defaults as DeltaBody's, any other field refused."""
    fields = [(f.name, f.type, msgspec.field(default=f.default, name=f.encode_name))
              for f in msgspec.structs.fields(DeltaBody) if f.name in PLAIN_BODY_FIELDS]
    body = msgspec.defstruct("PlainBody", fields, frozen=True, omit_defaults=True,
                             forbid_unknown_fields=True, gc=False)
    return msgspec.defstruct("PlainDelta", [("epoch", int), ("seq", int), ("digest", int),
                                            ("body", body)],
                             frozen=True, array_like=True, tag=Delta.__struct_config__.tag,
                             gc=False)


PlainDelta = _plain_view()
_PLAIN_DECODER = msgspec.msgpack.Decoder(PlainDelta)


def may_be_plain(frame: bytes) -> bool:
    """Whether a Delta frame's body map is empty or opens with a plain field's key (keys
    come in field order; all but two other fields precede the plain ones): the test
    that spares :func:`decode_plain` a failed decode of most other bodies.  The
    reference of the C ``plain_frame``."""
    at = _body_offset(frame)
    if at >= len(frame):
        return False
    head, n = frame[at], -1
    if head & 0xF0 == 0x80:
        n = head & 0x0F
    elif head == 0xDE and at + 2 < len(frame):
        n, at = frame[at + 1] << 8 | frame[at + 2], at + 2
    if n == 0:
        return True
    return n > 0 and at + 3 < len(frame) and frame[at + 1] == 0xA2 \
        and frame[at + 2:at + 4] in (b"ba", b"so", b"ps")


def decode_plain(frame: Any) -> Any:
    """The frame (``bytes``) of a Delta whose body sets nothing but
    :data:`PLAIN_BODY_FIELDS`, read as a :data:`PlainDelta` (its ``body`` has those
    fields alone); None for any other frame, bad ones and other buffer types included
    (:func:`decode` then decides, and raises for bad frames)."""
    if type(frame) is not bytes or len(frame) > PLAIN_FRAME_LIMIT \
            or not (_C.plain_frame(frame) if _C is not None else may_be_plain(frame)):
        return None
    try:
        return _PLAIN_DECODER.decode(frame)
    except DECODE_ERRORS:
        return None


def decode(frames: Sequence[Any], *, copy: bool = False,
           max_frames: int = DEFAULT_MAX_FRAMES) -> AnyMessage:
    """Decode frames to a message.  Tensors alias the frames unless ``copy``."""
    if not frames or len(frames) > max_frames:
        raise MalformedMessage("bad frame count", frames=len(frames))
    if len(frames) == 1:  # the common case: no tensors, no hook state to set up
        body = frames[0]
        try:
            return _SINGLE_FRAME_DECODER.decode(body if type(body) is bytes else _as_buffer(body))
        except ProtocolError:
            raise
        except DECODE_ERRORS as exc:
            raise _malformed(exc) from exc
    rest = _TensorFrames([_as_buffer(f) for f in frames[1:]])
    msg = _decode_body(_as_buffer(frames[0]), make_ext_hook(rest, copy=copy))
    if sorted(rest.referenced) != list(range(len(rest))):
        raise MalformedMessage("every tensor frame must be referenced exactly once",
                               frames=len(rest), references=len(rest.referenced))
    return msg


class _TensorFrames(Sequence[Any]):
    """The extra frames of one decode, recording which ones the body references."""

    def __init__(self, frames: list[Any]) -> None:
        self._frames = frames
        self.referenced: list[int] = []

    def __len__(self) -> int:
        return len(self._frames)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        self.referenced.append(index)
        return self._frames[index]


def encoded_size(frames: Sequence[Any]) -> int:
    """Bytes of a message: the sum of its frame lengths."""
    return sum(len(_as_buffer(f)) if not isinstance(f, memoryview) else f.nbytes for f in frames)
