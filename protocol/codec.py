"""Frames ⇄ messages.

``encode(msg)`` returns ``[body, *tensor_frames]``: frame 0 is the msgpack body,
every tensor (anywhere inside the message) follows as its own zero-copy frame.
"Bytes of a message" means the sum of its frame lengths.  ``decode(frames)`` accepts
``bytes``, ``memoryview`` or ``zmq.Frame`` objects and raises
:class:`MalformedMessage` -- and nothing else -- for any bad input.

Encoders and decoders with a tensor hook are built once per thread (the hook keeps
per-call scratch); a message without tensors uses shared hook-free codecs.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgspec

from protocol.errors import DECODE_ERRORS, MalformedMessage, ProtocolError, malformed
from protocol.messages import AnyMessage, Delta, Message
from protocol.tensors import make_enc_hook, make_ext_hook

Frame = bytes | memoryview
DEFAULT_MAX_FRAMES = 1 << 16

_local = threading.local()
_PLAIN_ENCODER = msgspec.msgpack.Encoder()  # stateless: shared by all threads


def _encoder() -> tuple[msgspec.msgpack.Encoder, list[Any]]:
    enc = getattr(_local, "encoder", None)
    if enc is None:
        aux: list[Any] = []
        enc = (msgspec.msgpack.Encoder(enc_hook=make_enc_hook(aux)), aux)
        _local.encoder = enc
    return enc  # type: ignore[no-any-return]


def encode(msg: Message) -> list[Frame]:
    """Encode ``msg`` to frames; tensor frames alias the sender's memory (SPEC §11)."""
    if type(msg) is Delta and not msg.body.added:  # only added requests hold tensors
        try:
            return [_PLAIN_ENCODER.encode(msg)]
        except TypeError:
            pass  # something off-schema: the hooked encoder decides
    encoder, aux = _encoder()
    aux.clear()
    try:
        return [encoder.encode(msg), *aux]
    finally:
        aux.clear()


def _as_buffer(frame: Any) -> Any:
    return frame.buffer if hasattr(frame, "buffer") else frame


def no_tensor_frames(code: int, data: memoryview) -> Any:
    """The ext hook of a single-frame message: any tensor reference is malformed."""
    raise MalformedMessage("message references a tensor frame it does not have", code=code)


_SINGLE_FRAME_DECODER = msgspec.msgpack.Decoder(AnyMessage, ext_hook=no_tensor_frames)


def _ext_hook(code: int, data: memoryview) -> Any:
    """Resolve a tensor Ext against the frames of the decode in progress (thread-local)."""
    return _local.ext_hook(code, data)


def _decoder() -> msgspec.msgpack.Decoder[AnyMessage]:
    dec = getattr(_local, "decoder", None)
    if dec is None:
        dec = msgspec.msgpack.Decoder(AnyMessage, ext_hook=_ext_hook)
        _local.decoder = dec
    return dec


def decode(frames: Sequence[Any], *, copy: bool = False,
           max_frames: int = DEFAULT_MAX_FRAMES) -> AnyMessage:
    """Decode frames to a message.  Tensors alias the frames unless ``copy``."""
    if not frames or len(frames) > max_frames:
        raise MalformedMessage("bad frame count", frames=len(frames))
    if len(frames) == 1:  # the common case: no tensors, no hook state to set up
        try:
            return _SINGLE_FRAME_DECODER.decode(_as_buffer(frames[0]))
        except ProtocolError:
            raise
        except DECODE_ERRORS as exc:
            raise malformed("frames do not decode to a message", exc) from exc
    rest = _TensorFrames([_as_buffer(f) for f in frames[1:]])
    _local.ext_hook = make_ext_hook(rest, copy=copy)
    try:
        msg = _decoder().decode(_as_buffer(frames[0]))
    except ProtocolError:
        raise
    except DECODE_ERRORS as exc:
        raise malformed("frames do not decode to a message", exc) from exc
    finally:
        _local.ext_hook = None  # never keep a message's frames alive past its decode
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
    return sum(f.nbytes if isinstance(f, memoryview) else len(_as_buffer(f)) for f in frames)
