"""The HMAC seal: a dict of arbitrary Python objects, pickled, authenticated, numbered.

Pure (no sockets, threads or clock).  The control plane of the vLLM adapter sends
objects no typed schema can hold (vLLM's callables, connector metadata) as a sealed
pickle: SPEC §16 ("The seal") is normative; in short, a blob is ::

    version (1 byte, 1) | counter (8 bytes, big-endian) | MAC (32 bytes) | pickle

with ``MAC = HMAC-SHA256(secret, b"deltacast-seal\\0" + label + b"\\0" + version +
counter + pickle)``.  The **label** names the direction and purpose (``b"call"``,
``b"result:3"``, ...) and is not sent: the receiver supplies the one it expects, so a
blob sealed for one purpose never opens as another.  Each :class:`Sealer` numbers its
blobs 1, 2, 3, ...; each :class:`Opener` accepts only counters above the last it
accepted (gaps allowed), so a captured blob cannot be replayed or reordered.

Contract: :meth:`Opener.open` verifies the MAC (``hmac.compare_digest``) before
anything is unpickled, and raises :class:`BadSeal` -- and nothing else -- for any
blob it refuses.  The secret is per run and every holder of it can seal (see SPEC §13).
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
import struct
from typing import Any

from protocol.errors import LocalProtocolError, RemoteProtocolError

VERSION = 1
_HEAD = struct.Struct(">BQ")  # version, counter
MAC_BYTES = 32
OVERHEAD = _HEAD.size + MAC_BYTES  # bytes of a blob before its pickle
_DOMAIN = b"deltacast-seal\x00"


class BadSeal(RemoteProtocolError):
    """A sealed blob refused: short, another version, a MAC that does not verify (wrong
    secret or label, or tampered), a replayed or reordered counter, or an authenticated
    payload that is not a pickled dict.  Nothing unauthenticated was unpickled."""


def _mac(key: bytes, label: bytes, head: bytes | memoryview, payload: bytes | memoryview,
         ) -> bytes:
    h = hmac.new(key, _DOMAIN + label + b"\x00", hashlib.sha256)
    h.update(head)
    h.update(payload)
    return h.digest()


def _check(secret: bytes, label: bytes) -> None:
    if not secret:
        raise LocalProtocolError("a seal needs a non-empty shared secret")
    if b"\x00" in label:
        raise LocalProtocolError("a seal label must not contain NUL", label=label)


class Sealer:
    """Seals dicts for one ``label`` (one direction and purpose); not thread-safe (one
    sender: blobs must be sent in the order they were sealed)."""

    def __init__(self, secret: bytes, label: bytes) -> None:
        _check(secret, label)
        self._secret, self.label = secret, label
        self.counter = 0  # of the last blob sealed

    def seal(self, objects: dict[str, Any]) -> bytes:
        """``objects`` pickled, numbered and authenticated (see the module docstring)."""
        if type(objects) is not dict:
            raise LocalProtocolError("only a dict is sealed", got=type(objects).__name__)
        self.counter += 1
        head = _HEAD.pack(VERSION, self.counter)
        payload = pickle.dumps(objects, protocol=5)
        return head + _mac(self._secret, self.label, head, payload) + payload


class Opener:
    """Opens the blobs of one ``label``'s Sealer, each at most once and in order."""

    def __init__(self, secret: bytes, label: bytes) -> None:
        _check(secret, label)
        self._secret, self.label = secret, label
        self.counter = 0  # of the last blob accepted

    def open(self, blob: bytes | memoryview) -> dict[str, Any]:
        """The sealed dict; raises BadSeal (nothing unpickled unless the MAC verified) for
        a blob refused.  Only an accepted blob advances the counter."""
        view = memoryview(blob).cast("B")
        if view.nbytes <= OVERHEAD:
            raise BadSeal("sealed blob too short", size=view.nbytes)
        version, counter = _HEAD.unpack_from(view)
        if version != VERSION:
            raise BadSeal("sealed blob of another version", version=version)
        head, mac, payload = view[:_HEAD.size], view[_HEAD.size:OVERHEAD], view[OVERHEAD:]
        if not hmac.compare_digest(_mac(self._secret, self.label, head, payload), mac):
            raise BadSeal("sealed blob MAC does not verify (wrong secret or label, or "
                          "tampered)", label=self.label)
        if counter <= self.counter:
            raise BadSeal("sealed blob replayed or out of order", counter=counter,
                          last=self.counter, label=self.label)
        try:
            objects = pickle.loads(payload)  # authenticated above
        except Exception as exc:  # (a sender's own bad pickle: still refused, typed)
            raise BadSeal("sealed payload does not unpickle",
                          cause=f"{type(exc).__name__}: {str(exc)[:200]}") from exc
        if type(objects) is not dict:
            raise BadSeal("sealed payload is not a dict", got=type(objects).__name__)
        self.counter = counter
        return objects


class ChannelSeals:
    """One end's seals of the step channel's opaque objects: a Sealer of the label it
    ``sends`` and an Opener of the one it ``receives`` (neither without a secret)."""

    def __init__(self, secret: bytes | None, sends: bytes, receives: bytes) -> None:
        self.sealer = Sealer(secret, sends) if secret else None
        self.opener = Opener(secret, receives) if secret else None

    def seal(self, objects: dict[str, Any]) -> bytes:
        """``objects`` sealed (``b""``: none); LocalProtocolError without a secret."""
        if not objects:
            return b""
        if self.sealer is None:
            raise LocalProtocolError("connector objects need a shared secret",
                                     names=sorted(objects))
        return self.sealer.seal(objects)

    def open(self, blob: bytes) -> dict[str, Any]:
        """The objects of a sealed field (``{}`` for an empty field: nothing sealed, not
        opened); BadSeal for a blob refused, or for any blob without a secret."""
        if not blob:
            return {}
        if self.opener is None:
            raise BadSeal("a sealed field, but no secret to open it with")
        return self.opener.open(blob)
