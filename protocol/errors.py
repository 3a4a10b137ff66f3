"""Typed error hierarchy (h11 split, h2 structured fields).

Expected network events -- a gap, a duplicate, silence, a new epoch -- are *not*
errors: the worker replica reports them as events and states.  Exceptions are
reserved for misuse by the local caller and for bytes from a peer that break the
protocol.
"""

from __future__ import annotations

import struct
import zlib

import msgspec


class ProtocolError(Exception):
    """Base class; never raised directly (use a subclass)."""

    def __init__(self, message: str, **fields: object) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise a subclass")
        super().__init__(message)
        self.message = message
        self.fields = fields

    def __str__(self) -> str:
        if not self.fields:
            return self.message
        detail = ", ".join(f"{k}={v!r}" for k, v in self.fields.items())
        return f"{self.message} ({detail})"


class LocalProtocolError(ProtocolError):
    """Our own caller broke a rule (bad argument, call in the wrong state)."""


class RemoteProtocolError(ProtocolError):
    """Bytes or messages received from the peer are unacceptable."""


class MalformedMessage(RemoteProtocolError):
    """Frames that do not decode to a valid message (the one error for bad input)."""


class IncompatibleVersion(RemoteProtocolError):
    """The peer speaks a protocol major version (or needs features) we lack."""

    def __init__(self, message: str, *, ours: object, theirs: object) -> None:
        super().__init__(message, ours=ours, theirs=theirs)
        self.ours = ours
        self.theirs = theirs


class InvalidDelta(RemoteProtocolError):
    """A well-formed delta that cannot apply to the state it claims as base."""


#: What a decoder may raise for bad bytes, and nothing else: msgspec's DecodeError (and
#: its ValidationError), ValueError (invalid UTF-8, numpy's frombuffer/reshape),
#: TypeError, OverflowError, RecursionError (values nested past the interpreter's
#: limit: msgspec recurses even to skip an unknown field), IndexError and KeyError
#: (lists or maps that do not fit), struct.error and zlib.error.  Every decode site of
#: a peer's bytes catches exactly this tuple and raises MalformedMessage.
DECODE_ERRORS: tuple[type[Exception], ...] = (
    msgspec.DecodeError, ValueError, TypeError, OverflowError, RecursionError, IndexError,
    KeyError, struct.error, zlib.error)


def malformed(what: str, exc: BaseException) -> MalformedMessage:
    """The MalformedMessage for a decode of ``what`` that raised ``exc`` (one of
    :data:`DECODE_ERRORS`): raise it ``from exc``."""
    return MalformedMessage(what, cause=f"{type(exc).__name__}: {str(exc)[:200]}")
