"""The executor channel's wire vocabulary (SPEC §16): call and answer kinds, the
doorbell, rank identities and the check-in payload.  Pure: no sockets, no model code.

An engine-side executor calls every rank (a DEALER whose identity is its rank in
ASCII decimal) with ``[head, *frames]``; each rank answers every call once, in call
order.  Engine → rank: ``X`` execute (a step's frames), ``T`` execute then sample
with no grammar (a step's frames; one answer), ``S`` sample (grammar frames), ``C``
control (one sealed call), ``A`` attach (one sealed store map), ``Q`` quit.  Rank →
engine: ``R`` ready, ``F`` failed to start (text), ``O`` output frames (the output
rank), ``K`` done (other ranks), ``C`` sealed control result, ``E`` an exception
(text); unsolicited, ``H`` a check-in with a 16-byte payload (``steps``
int64, ``hash`` uint64, little-endian).  A single empty frame is a doorbell: it only
wakes a rank that announced it sleeps (§7.6).

Every call is numbered: its first frame is the **call head**, ``kind + number + crc``
(1 + 8 + 4 bytes: the call number from 1, uint64, and the CRC-32 of the call's other
frames in order, uint32; little-endian).  A rank that finds a call missing (a later
number, or a ``P`` ping naming a number it has not seen) or damaged (the CRC does not
match) asks for it again with ``N`` (8 bytes: the first number it lacks); the engine
answers from the last calls it keeps with ``Y`` followed by each call's frames, in
order, or fails the executor when they are gone.

A rank on another host (over tcp with CURVE) first says ``h`` hello with a JSON object
of strings: ``node`` (its node rank), ``vllm`` (version), ``protocol`` (major) and
``config`` (the hash of the model config it built); the engine answers ``w`` welcome,
then the 32-byte secret of the sealed calls (only ever over the authenticated channel)
and the rank's settings (``hash_every`` uint32, ``spin_s`` float64, little-endian), or
``x`` refused with one line of text saying what differs, and the rank exits.

Those ranks reach the engine through their node's **relay**: one connection per node
(a DEALER whose identity is ``node<K>/<G>``, K the node, G its generation of ranks),
carrying each message as one frame, :func:`pack_relayed` of ``[target, *frames]``:
the target is a rank's identity, or ``*`` (every rank of the node) for a call the
engine sends them all.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence
from typing import Any

from protocol.errors import LocalProtocolError, MalformedMessage, malformed

# engine -> rank
EXECUTE, SAMPLE, CONTROL, ATTACH, QUIT = b"X", b"S", b"C", b"A", b"Q"
STEP = b"T"  # as EXECUTE, then sample_tokens with no GrammarOutput if that returned nothing
RESENT, PING = b"Y", b"P"  # a call again (then its frames); the newest call number (8 B)
# rank -> engine (CONTROL answers a control call with its sealed result)
READY, FAILED, OUTPUT, DONE, ERROR, CHECK_IN = b"R", b"F", b"O", b"K", b"E", b"H"
RESEND = b"N"  # 8 bytes: the first call number the rank lacks
ASK_AGAIN_S = 1.0  # a rank repeats an unanswered N this often (at most)
HELLO, WELCOME, REFUSED = b"h", b"w", b"x"  # a remote rank's hello and the engine's answers
LIVENESS_S = 0.6  # deltacast_liveness_s's default: a peer unheard this long is lost


def heartbeat_ms(liveness_s: float) -> tuple[int, int]:
    """ZMTP (HEARTBEAT_IVL, HEARTBEAT_TIMEOUT) in ms for a liveness bound: a heartbeat
    every quarter of it, the link lost past it."""
    return max(1, int(liveness_s * 250)), int(liveness_s * 1000)


RESTART = b"restart"  # a QUIT's one frame: the group restarts (a rank on another node exits
RESTART_EXIT = 75  # with this status, and its node starts its ranks again)
HELLO_FIELDS = ("node", "vllm", "protocol", "config")
WELCOME_SETTINGS = struct.Struct("<Id")  # hash_every, spin_s
CALL_HEAD = struct.Struct("<cQI")  # kind, number, CRC-32 of the other frames
NUMBER = struct.Struct("<Q")
#: the kinds of a rank's answer to a call
ANSWER_KINDS = (OUTPUT, DONE, CONTROL, ERROR)
#: the calls a rank other than the output rank may answer late, several in one ``K``
STEP_KINDS = (EXECUTE, STEP, SAMPLE)
DONE_MAX = 64  # such a rank answers at least every this many step calls
_DONE_COUNT = struct.Struct("<I")


def done_answer(count: int) -> list[bytes]:
    """``K`` answering ``count`` calls (>= 1)."""
    return [DONE] if count == 1 else [DONE, _DONE_COUNT.pack(count)]


def done_count(answer: Sequence[bytes]) -> int | None:
    """How many calls a ``K`` answer answers; None if it is malformed."""
    if len(answer) == 1:
        return 1
    if len(answer) != 2 or len(answer[1]) != _DONE_COUNT.size:
        return None
    return _DONE_COUNT.unpack(answer[1])[0] or None
#: a call over this many bytes goes on the socket behind its ring marker (the engine's
#: ring and a node's alike: it bounds what a ring holds in flight)
RING_CALL_LIMIT = 1 << 20

CHECK_IN_PAYLOAD = struct.Struct("<qQ")  # outputs folded (int64), hash (uint64)
RELAY_ALL = b"*"  # a relayed message's target: every rank of the node
_RELAY_COUNT = struct.Struct("<H")
#: at most this many frames in one relayed message (the count's 15 bits: its top bit
#: marks a deflated message); a step's or an answer's tensors are a frame each
RELAY_FRAMES = 0x7FFF
_DEFLATED = 0x8000  # in a relayed message's count: its lengths and frames are deflated
_INFLATED = struct.Struct("<I")  # a deflated relayed message's size, inflated
#: frames of this many bytes in all (from .. to) cross between hosts deflated
RELAY_DEFLATE_MIN, RELAY_DEFLATE_MAX = 4 << 10, 4 << 20


def rank_of(identity: bytes, world_size: int) -> int | None:
    """The rank a DEALER identity names (ASCII decimal, no leading zero), else None."""
    rank = int(identity) if identity.isdigit() and len(identity) <= 6 else -1
    return rank if 0 <= rank < world_size and identity == b"%d" % rank else None


def relay_identity(node: int, generation: int) -> bytes:
    """The identity of node ``node``'s relay for its ``generation``-th ranks."""
    return b"node%d/%d" % (node, generation)


def relay_node(identity: bytes) -> int | None:
    """The node a relay's identity names, else None."""
    name, slash, generation = identity.partition(b"/")
    if not slash or not name.startswith(b"node") or not generation.isdigit():
        return None
    node = name[4:]
    return int(node) if node.isdigit() and len(node) <= 6 else None


def pack_relayed(frames: Sequence[Any]) -> bytes:
    """Several frames as one: their count (uint16), each one's length (uint32), then
    the frames, little-endian; between RELAY_DEFLATE_MIN and RELAY_DEFLATE_MAX bytes of
    frames, the lengths and frames deflated (zlib, level 1) behind their inflated size
    (uint32) and the count's top bit, when that saves a tenth.  ``frames`` are a target
    and what goes to it: LocalProtocolError for fewer than two, or more than RELAY_FRAMES."""
    if len(frames) > RELAY_FRAMES:
        raise LocalProtocolError("too many frames to relay", frames=len(frames),
                                 limit=RELAY_FRAMES)
    if len(frames) < 2:
        raise LocalProtocolError("a relayed message is a target and its frames",
                                 frames=len(frames))
    lengths = [memoryview(f).nbytes for f in frames]
    head = struct.pack(f"<{len(lengths)}I", *lengths)
    size = len(head) + sum(lengths)  # inflated
    if RELAY_DEFLATE_MIN <= size - len(head) <= RELAY_DEFLATE_MAX:
        zip_ = zlib.compressobj(1)
        packed = b"".join([*map(zip_.compress, [head, *frames]), zip_.flush()])
        if len(packed) < size * 0.9:
            return b"".join([_RELAY_COUNT.pack(len(lengths) | _DEFLATED),
                             _INFLATED.pack(size), packed])
    return b"".join([_RELAY_COUNT.pack(len(lengths)), head, *frames])


def unpack_relayed(payload: Any) -> list[memoryview]:
    """The frames of a :func:`pack_relayed` payload (views into it, or into its
    inflated bytes): a target and at least one frame, at most RELAY_FRAMES in all;
    MalformedMessage if it is not one."""
    view = memoryview(payload).cast("B")
    if len(view) < _RELAY_COUNT.size:
        raise MalformedMessage("a relayed message without its frame count", size=len(view))
    (count,) = _RELAY_COUNT.unpack_from(view)
    view = view[_RELAY_COUNT.size:]
    if count & _DEFLATED:
        count &= ~_DEFLATED
        view = _inflate(view)
    at = 4 * count
    if not 1 < count <= RELAY_FRAMES or at > len(view):
        raise MalformedMessage("a relayed message's frame count is wrong", size=len(view))
    frames = []
    for length in struct.unpack_from(f"<{count}I", view):
        if at + length > len(view):
            raise MalformedMessage("a relayed frame runs past its message", size=len(view))
        frames.append(view[at:at + length])
        at += length
    if at != len(view):
        raise MalformedMessage("bytes after a relayed message's frames", size=len(view))
    return frames


def _inflate(view: memoryview) -> memoryview:
    """The lengths and frames of a deflated relayed message: exactly the size it claims,
    at most RELAY_DEFLATE_MAX bytes of frames (MalformedMessage otherwise)."""
    if len(view) < _INFLATED.size:
        raise MalformedMessage("a deflated relayed message without its size", size=len(view))
    (size,) = _INFLATED.unpack_from(view)
    if size > RELAY_DEFLATE_MAX + 4 * RELAY_FRAMES:
        raise MalformedMessage("a deflated relayed message claims too much", claims=size)
    unzip = zlib.decompressobj()
    try:
        body = unzip.decompress(view[_INFLATED.size:], size + 1)
    except zlib.error as exc:
        raise malformed("a deflated relayed message that does not inflate", exc) from exc
    if len(body) != size or not unzip.eof or unzip.unconsumed_tail or unzip.unused_data:
        raise MalformedMessage("a deflated relayed message is not the size it claims",
                               claims=size, size=len(body))
    return memoryview(body)


def pack_check_in(steps: int, value: int) -> bytes:
    """An ``H`` payload: ``value`` is the rank's hash after ``steps`` outputs."""
    return CHECK_IN_PAYLOAD.pack(steps, value)


def parse_check_in(payload: bytes) -> tuple[int, int]:
    """``(steps, value)`` of a check-in payload; raises MalformedMessage if malformed."""
    if len(payload) != CHECK_IN_PAYLOAD.size:
        raise MalformedMessage("check-in payload is not 16 bytes", size=len(payload))
    steps, value = CHECK_IN_PAYLOAD.unpack(payload)
    return int(steps), int(value)


def ready_seconds(frames: Sequence[bytes]) -> float:
    """The seconds an ``R``'s optional frame says the rank took to start its device and
    load its model (ASCII decimal); 0.0 when absent or not such a number (it only
    informs the engine's log)."""
    try:
        seconds = float(frames[0].decode("ascii")) if len(frames) == 1 and \
            len(frames[0]) <= 16 else 0.0
    except (UnicodeDecodeError, ValueError):
        return 0.0
    return seconds if 0.0 <= seconds < 1e7 else 0.0


def pack_hello(**fields: str) -> bytes:
    """An ``h`` payload of exactly HELLO_FIELDS (strings)."""
    if tuple(sorted(fields)) != tuple(sorted(HELLO_FIELDS)):
        raise ValueError(f"a hello has exactly the fields {HELLO_FIELDS}")
    return json.dumps(fields, sort_keys=True).encode()


def parse_hello(payload: bytes) -> dict[str, str]:
    """The fields of an ``h`` payload; MalformedMessage unless exactly HELLO_FIELDS,
    each a string of at most 256 characters."""
    try:
        fields = json.loads(payload) if len(payload) <= 4096 else None
    except (ValueError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        fields = None
    if not isinstance(fields, dict) or sorted(fields) != sorted(HELLO_FIELDS) or any(
            not isinstance(v, str) or len(v) > 256 for v in fields.values()):
        raise MalformedMessage("a hello is a JSON object of the hello fields", size=len(payload))
    return fields


def frames_crc(frames: Sequence[Any]) -> int:
    """CRC-32 of ``frames`` in order (each a bytes-like object)."""
    crc = 0
    for f in frames:
        crc = zlib.crc32(f, crc)
    return crc


def call_head(kind: bytes, number: int, frames: Sequence[Any]) -> bytes:
    """The first frame of call ``number`` of ``kind`` whose other frames are ``frames``."""
    return CALL_HEAD.pack(kind, number, frames_crc(frames))


def parse_call(call: Sequence[Any]) -> tuple[bytes, int, bool]:
    """(kind, number, intact) of a call ``[head, *frames]``, intact when the frames match
    the head's CRC; MalformedMessage for a head that is not one."""
    if not call or len(call[0]) != CALL_HEAD.size:
        raise MalformedMessage("a call without its head")
    kind, number, crc = CALL_HEAD.unpack(call[0])
    return kind, number, frames_crc(call[1:]) == crc


def parse_number(payload: bytes) -> int:
    """The call number of a ``P`` or ``N`` payload; MalformedMessage if malformed."""
    if len(payload) != NUMBER.size:
        raise MalformedMessage("a call number is 8 bytes", size=len(payload))
    return int(NUMBER.unpack(payload)[0])
