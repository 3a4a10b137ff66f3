"""SPEC.md's normative tables and the code must say the same thing.

The tables are parsed and compared, in both directions, with what the code runs on:
the replica transition table and its missing pairs, the message tags, every wire
Struct's field table (short key or position, name, type and default) against
``msgspec.structs.fields``, the version and feature bits, the recording refusal, the
tensor dtype codes, the packed-array examples, the local ring's layout and the
executor call kinds.  (h11 renders its state diagram from its table for the same
reason.)  The checkers return their findings, so the tests at the end show that each
one notices an edited copy of the text.  §5 and §8.3 executed: ``test_spec_model.py``;
§14 replayed: ``test_spec_example.py``.
"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import msgspec
import pytest
from spec_text import (
    CATALOGUE_HEADER,
    TRANSITION_HEADER,
    edit_table,
    read_spec,
    section,
    squash,
    table_at,
)

from protocol import bitmask, ext, recording, tensors
from protocol import messages as wire
from protocol.errors import IncompatibleVersion
from protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    SUPPORTED_FEATURES,
    DeltaBody,
    Hello,
    NewRequest,
    RareBody,
    Rows,
    SnapshotBody,
    SnapshotRequest,
)
from protocol.packing import pack_sints, pack_uints
from protocol.params import SamplingSpec
from protocol.state import ReplicaState
from worker_side.replica import TRANSITIONS, Action, Input, State, WorkerReplica


@pytest.fixture(scope="module")
def spec() -> str:
    return read_spec()


# -- §9 ------------------------------------------------------------------------------------
def transition_problems(text: str) -> list[str]:
    _, rows = table_at(text, TRANSITION_HEADER)
    try:
        parsed = [((State(s), Input(i)), (Action(a), State(n))) for s, i, a, n in rows]
    except ValueError as exc:
        return [f"unknown name in the transition table: {exc}"]
    out = []
    if len(dict(parsed)) != len(parsed):
        out.append("a (state, input) pair is listed twice")
    for pair, entry in parsed:
        if TRANSITIONS.get(pair) != entry:
            out.append(f"{pair}: text {entry}, code {TRANSITIONS.get(pair)}")
    out += [f"{pair} missing from the text" for pair in TRANSITIONS.keys() - dict(parsed)]
    if not out and [p for p, _ in parsed] != list(TRANSITIONS):
        out.append("rows are not in the code's order")
    return out


def test_transition_table_equals_code(spec: str) -> None:
    assert transition_problems(spec) == []


def test_classification_names_every_input(spec: str) -> None:
    _, rows = table_at(spec, "| Message | Condition | Input |")
    assert {Input(r[2]) for r in rows} == set(Input)


def test_missing_pairs_are_listed(spec: str) -> None:
    match = re.search(r"Intentionally missing:(.*?)\n\n", spec, re.S)
    assert match is not None, "SPEC.md must list the intentionally missing pairs"
    listed = {(State(s), Input(i)) for s, i in re.findall(r"\(`(\w+)`, `(\w+)`\)", match.group(1))}
    missing = {(s, i) for s in State for i in Input} - TRANSITIONS.keys()
    assert listed == missing


def test_worker_messages_are_not_replica_inputs(spec: str) -> None:
    from protocol.errors import RemoteProtocolError

    w = WorkerReplica()
    with pytest.raises(RemoteProtocolError):
        w.receive(SnapshotRequest(epoch=1, seq=0), 0.0)
    assert "feeding one raises RemoteProtocolError, the state unchanged" in squash(spec)


# -- §6: catalogue and field tables --------------------------------------------------------
def test_message_catalogue_tags(spec: str) -> None:
    _, rows = table_at(spec, CATALOGUE_HEADER)
    parsed = {name: int(tag) for tag, name, _, _ in rows}
    assert len(parsed) == len(rows)
    assert parsed == {cls.__name__: cls.__struct_config__.tag for cls in MESSAGE_TYPES}


def render_type(t: Any, element: bool = False) -> str:
    """A field's Python type in SPEC.md's words (``packed``/``bin`` are ``bytes``)."""
    if t is Any:
        return "any"
    if t is bytes:
        return "bytes"
    if t is msgspec.Raw:
        return "Spec"  # NewRequest.s: a Spec map embedded as is
    if t in (int, str, bool, float):
        return str(t.__name__)
    origin, args = get_origin(t), get_args(t)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        assert len(rest) == 1, t
        text = f"{render_type(rest[0])} or nil"
        return f"({text})" if element else text
    if origin is Literal:
        return "str"
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"array of {render_type(args[0], element=True)}"
    if origin is tuple:
        return "[" + ", ".join(render_type(a) for a in args) + "]"
    if origin is dict:
        return f"map {render_type(args[0])} → {render_type(args[1])}"
    if isinstance(t, type) and issubclass(t, msgspec.Struct):
        return t.__name__
    raise TypeError(f"no SPEC.md word for {t!r}")


def render_default(f: msgspec.structs.FieldInfo) -> str:
    if f.default is msgspec.NODEFAULT:
        if f.default_factory is msgspec.NODEFAULT:
            return "REQUIRED"
        return "[]" if f.default_factory in (list, tuple) else "{}"
    d = f.default
    if d is None:
        return "nil"
    if isinstance(d, bool):
        return str(d).lower()
    if isinstance(d, int):
        return str(d)
    if isinstance(d, msgspec.Struct):
        return "{}"
    return {b"": "empty", "": '""', (): "[]"}[d]


def spec_type(cell: str) -> str:
    """A Type cell in :func:`render_type`'s words."""
    return re.sub(r"\bpacked signed\b|\bpacked\b|\bbin\b", "bytes", cell)


MAP_TABLES: tuple[type[msgspec.Struct], ...] = (
    DeltaBody, RareBody, NewRequest, wire.Spec, wire.MMItem, Rows, SnapshotBody,
    ext.StepExt, ext.TokenRef, ext.NewFix, ext.ReplyMsg, ext.KVOutputWire)
ARRAY_TABLES: tuple[type[msgspec.Struct], ...] = (
    bitmask.GrammarMsg, bitmask.Deflated, bitmask.SparseWords, bitmask.RowRefs,
    ext.LogprobsWire)


def struct_table_problems(text: str, cls: type[msgspec.Struct]) -> list[str]:
    """Differences between ``cls``'s table in ``text`` and its fields, both ways and in
    order: key (map) or position (array, message), name, type, default."""
    fields = msgspec.structs.fields(cls)
    if cls in MESSAGE_TYPES:
        anchor = f"#### {cls.__name__} (tag {cls.__struct_config__.tag})"
        want = [(str(i + 1), f) for i, f in enumerate(fields)][2:]  # 0 is the tag
    elif cls.__struct_config__.array_like:
        anchor = f"#### {cls.__name__}"
        want = [(str(i), f) for i, f in enumerate(fields)]
    else:
        anchor = f"#### {cls.__name__}"
        want = [(f.encode_name, f) for f in fields]
    header, rows = table_at(text, anchor)
    if header[:4] != ["Position" if want and want[0][0].isdigit() else "Key", "Field", "Type",
                      "Default"]:
        return [f"{cls.__name__}: unexpected header {header[:4]}"]
    got = {r[0]: tuple(r[1:4]) for r in rows}
    out = [f"{cls.__name__}: {r[0]!r} listed twice" for r in rows
           if [x[0] for x in rows].count(r[0]) > 1][:1]
    code = {k: (f.name, render_type(f.type), render_default(f)) for k, f in want}
    for k, (name, typ, default) in code.items():
        if k not in got:
            out.append(f"{cls.__name__}: {k!r} ({name}) missing from SPEC.md")
            continue
        t_name, t_type, t_default = got[k]
        if (t_name, spec_type(t_type), t_default) != (name, typ, default):
            out.append(f"{cls.__name__}.{k}: text {got[k]}, code {(name, typ, default)}")
    out += [f"{cls.__name__}: {k!r} in SPEC.md is no field" for k in got.keys() - code.keys()]
    if not out and [r[0] for r in rows] != [k for k, _ in want]:
        out.append(f"{cls.__name__}: rows are not in wire order")
    return out


@pytest.mark.parametrize("cls", (*MESSAGE_TYPES, *MAP_TABLES, *ARRAY_TABLES),
                         ids=lambda c: c.__name__)
def test_field_table_equals_struct(spec: str, cls: type[msgspec.Struct]) -> None:
    assert struct_table_problems(spec, cls) == []


def test_every_wire_struct_has_a_table() -> None:
    """Both ways at the level of types: every Struct the wire modules define is a
    message or has a field table, and no table names a type they lack."""
    defined = {obj for mod in (wire, ext, bitmask) for obj in vars(mod).values()
               if isinstance(obj, type) and issubclass(obj, msgspec.Struct)
               and obj.__module__ == mod.__name__ and not obj.__name__.startswith("_")
               and obj is not wire.Message}
    assert defined == {*MESSAGE_TYPES, *MAP_TABLES, *ARRAY_TABLES}


def test_common_header(spec: str) -> None:
    _, rows = table_at(spec, "Common header (all messages):")
    assert [r[:4] for r in rows] == [["0", "tag", "int", "REQUIRED"],
                                     ["1", "epoch", "int", "REQUIRED"],
                                     ["2", "seq", "int", "REQUIRED"]]
    for cls in MESSAGE_TYPES:
        assert [f.name for f in msgspec.structs.fields(cls)][:2] == ["epoch", "seq"]


def test_map_headers_as_stated(spec: str) -> None:
    """§6.2: fixmap for a map type of at most 15 fields, map16 above -- and the text
    names exactly the larger ones."""
    text = squash(section(spec, "### 6.2 Bodies", "#### DeltaBody"))
    named = set(re.findall(r"map16 header \(`de 00 0n`\) for a larger one \(([^)]*)\)", text)
                [0].replace(" ", "").split(","))
    maps: list[type[msgspec.Struct]] = [*MAP_TABLES, SamplingSpec]
    big = {c.__name__ for c in maps if len(c.__struct_fields__) > 15}
    assert named == big
    for cls in maps:
        first = msgspec.msgpack.encode(msgspec.convert({}, cls) if cls is SamplingSpec
                                       else _some_instance(cls))[0]
        assert (0x80 <= first <= 0x8F) == (len(cls.__struct_fields__) <= 15), cls


def _some_instance(cls: type[msgspec.Struct]) -> Any:
    """An instance with every required field set (enough to see its map header)."""
    fill = {int: 0, str: "", bytes: b"", msgspec.Raw: msgspec.Raw(b"\x80")}
    return cls(**{f.name: fill[f.type] for f in msgspec.structs.fields(cls)
                  if f.required})


def test_rows_readings(spec: str) -> None:
    """§6.2's two readings of Rows: keys absent = every position (blocks, tokens,
    step-only rows) or no rows (the exception fields)."""
    text = squash(section(spec, "How each field reads its Rows", "#### SnapshotBody"))
    assert "`ba[g]`, `br[g]`, `ot`, `sp`, `ei`: `h` holds distinct positions `< |N|`; " \
           "`h` absent means every position `0 .. |N|-1`, in order." in text
    assert "`nt`, `nc`, `tr` (exceptions): `h` holds distinct positions `< |N|` and `v` " \
           "exactly one value per position; `h` absent means **no rows**" in text


# -- §12 -----------------------------------------------------------------------------------
def test_version_header(spec: str) -> None:
    match = re.search(r"^\* Version: (\d+)\.(\d+)", spec, re.M)
    assert match is not None
    assert (int(match.group(1)), int(match.group(2))) == (PROTOCOL_MAJOR, PROTOCOL_MINOR)
    text = section(spec, "## 12. Versioning", "## 13.")
    stated = re.search(r"`PROTOCOL_MAJOR = (\d+)`, `PROTOCOL_MINOR = (\d+)`", text)
    assert stated is not None and tuple(map(int, stated.groups())) == (PROTOCOL_MAJOR,
                                                                        PROTOCOL_MINOR)


def test_feature_bits(spec: str) -> None:
    text = squash(section(spec, "## 12. Versioning", "## 13."))
    named = {name: 1 << int(bit) for bit, name in re.findall(r"bit (\d) `(FEATURE_\w+)`", text)}
    code = {k: v for k, v in vars(wire).items() if k.startswith("FEATURE_")}
    assert named == code
    assert "bit 2 retired" in text and 1 << 2 not in code.values()
    supported = re.search(r"`SUPPORTED_FEATURES` = bits (\d) and (\d)", text)
    assert supported is not None
    assert sum(1 << int(b) for b in supported.groups()) == SUPPORTED_FEATURES


def test_another_major_is_refused_at_hello(spec: str) -> None:
    w = WorkerReplica(start=(1, ReplicaState()))
    with pytest.raises(IncompatibleVersion) as err:
        w.receive(Hello(epoch=1, seq=0, major=PROTOCOL_MAJOR - 1), 0.0)
    assert (err.value.ours, err.value.theirs) == (PROTOCOL_MAJOR, PROTOCOL_MAJOR - 1)
    assert w.state is State.SYNCED and w.seq == 0
    assert "A major-3 peer therefore refuses a major-2" in squash(spec)


def test_recording_format_and_refusal(spec: str, tmp_path: Path) -> None:
    """§12: the recording layout as written, and a file of another major refused."""
    text = squash(section(spec, "* Recordings (", "* msgspec `array_like`"))
    magic = re.search(r"magic `([^`]+)`", text)
    assert magic is not None
    assert magic.group(1).encode().decode("unicode_escape").encode("latin-1") == recording.MAGIC
    kinds = dict(re.findall(r"(\d) `(\w+)`", text))
    assert {v: int(k) for k, v in kinds.items()} == recording.KINDS
    header = re.search(r"`RecordHeader` map \(([^:]*):", text)
    assert header is not None
    assert re.findall(r"`(\w+)`", header.group(1)) == list(
        recording.RecordHeader.__struct_fields__)
    path = tmp_path / "old.dcrec"
    with recording.RecordWriter(path) as w:
        w.write("execute_model", [b"x"])
    assert recording.RecordReader(path).header.protocol == PROTOCOL_MAJOR
    data = path.read_bytes()
    n = int.from_bytes(data[16:20], "little")
    head = msgspec.msgpack.decode(data[20:20 + n])
    for older in (PROTOCOL_MAJOR - 1, None):  # major 2, and a file naming no major (1)
        if older is None:
            head.pop("protocol")
        else:
            head["protocol"] = older
        raw = msgspec.msgpack.encode(head)
        path.write_bytes(data[:16] + len(raw).to_bytes(4, "little") + raw + data[20 + n:])
        with pytest.raises(IncompatibleVersion) as err:
            recording.RecordReader(path)
        assert (err.value.ours, err.value.theirs) == (PROTOCOL_MAJOR, older or 1)


# -- §7 -------------------------------------------------------------------------------------
def test_dtype_codes(spec: str) -> None:
    start = spec.index("Dtype codes (never reassigned):")
    paragraph = spec[start : spec.index("\n\n", start)]
    parsed = {int(code): name for code, name in re.findall(r"(\d+)\s+(bool|[a-z]+\d+)", paragraph)}
    assert parsed == tensors._DTYPES


def test_packed_examples(spec: str) -> None:
    text = section(spec, "### 7.3 Packed integer arrays", "### 7.4")
    examples = re.findall(r"(signed )?`\[([-\d,]*)\]` = `([0-9a-f ]+)`", text)
    assert len(examples) == 4
    for signed, values, hexed in examples:
        ints = [int(v) for v in values.split(",") if v]
        assert (pack_sints if signed else pack_uints)(ints).hex(" ") == hexed


# -- §7.6 and §16.1 --------------------------------------------------------------------------
def test_local_ring_layout_and_record_kinds_match_the_code(spec: str) -> None:
    """§7.6's segment table and record kinds are the ones protocol/ring.py defines."""
    from protocol import ring

    _, rows = table_at(spec, "| Word | Name | Written by | Meaning |")
    words = {name: word for word, name, *_ in rows}
    fixed = {"magic": ring.W_MAGIC, "version": ring.W_VERSION, "ring_bytes": ring.W_RING,
             "ranks": ring.W_RANKS, "reply_bytes": ring.W_REPLY, "closed": ring.W_CLOSED,
             "head": ring.W_HEAD}
    assert {k: int(words[k]) for k in fixed} == fixed
    layout = ring.Layout(1024, 1024)
    assert words["sleeping[r]"] == f"{ring.HEADER_WORDS} + r" \
        and layout.sleeping_word(5) == ring.HEADER_WORDS + 5
    assert words["reply_head[r]"] == f"{ring.HEADER_WORDS} + R + r" \
        and layout.reply_word(5) == ring.HEADER_WORDS + layout.ranks + 5
    assert layout.ranks == ring.MAX_RANKS == 64 and "`R` = 64" in spec
    meaning = {name: row[-1] for _, name, *row in rows}
    assert f"{ring.MAGIC:#x}".lower() in meaning["magic"].lower()
    assert meaning["version"] == str(ring.VERSION)
    _, records = table_at(spec, "| Bytes | Field | Meaning |")
    kinds = dict(re.findall(r"(\d) `?([A-Z_]+)", records[1][2]))  # (cells lose end backticks)
    assert kinds == {str(ring.MESSAGE): "MESSAGE", str(ring.ON_PUB): "ON_PUB",
                     str(ring.WRAP): "WRAP"}


def test_executor_call_kinds_match_protocol_calls(spec: str) -> None:
    """§16's kind table is the vocabulary of protocol/calls.py: every kind, by direction,
    and the 16-byte `H` payload."""
    from protocol import calls

    _, rows = table_at(spec, "| Kind | Direction | Frames after the kind | Answer |")
    to_ranks: set[bytes] = set()
    to_engine: set[bytes] = set()
    for kind, direction, frames, _ in rows:
        names = {k.encode() for k in re.findall(r"\b([A-Za-z])\b", kind)}  # (`R` / `F`)
        (to_ranks if direction.startswith("engine") else to_engine).update(names)
        if names == {calls.CHECK_IN}:
            assert f"{calls.CHECK_IN_PAYLOAD.size} bytes" in frames
        if calls.WELCOME in names:
            assert f"{calls.WELCOME_SETTINGS.size} bytes of settings" in frames
        if names == {calls.HELLO}:
            assert all(f"`{field}`" in frames for field in calls.HELLO_FIELDS)
    assert to_ranks == {calls.EXECUTE, calls.STEP, calls.SAMPLE, calls.CONTROL, calls.ATTACH,
                        calls.QUIT, calls.RESENT, calls.PING, calls.WELCOME, calls.REFUSED}
    assert to_engine == {calls.READY, calls.FAILED, calls.OUTPUT, calls.DONE, calls.CONTROL,
                         calls.ERROR, calls.CHECK_IN, calls.RESEND, calls.HELLO}
    assert calls.CALL_HEAD.size == 13 and calls.CALL_HEAD.format == "<cQI"
    assert "13-byte **head**" in spec and calls.NUMBER.format == "<Q"
    assert calls.CHECK_IN_PAYLOAD.format == "<qQ"
    assert calls.WELCOME_SETTINGS.format == "<Id"  # hash_every uint32, spin_s float64


def test_relay_deflate_limits_as_stated(spec: str) -> None:
    """§16.1's deflated relayed messages: the bounds are protocol/calls.py's."""
    from protocol import calls

    text = squash(section(spec, "### 16.1", "### 16.2"))
    assert (calls.RELAY_DEFLATE_MIN, calls.RELAY_DEFLATE_MAX) == (4 << 10, 4 << 20)
    assert "hold 4 KiB to 4 MiB (`RELAY_DEFLATE_MIN`, `RELAY_DEFLATE_MAX`)" in text
    assert "claims more than 4 MiB + 131,068 bytes" in text and calls.RELAY_FRAMES * 4 == 131068
    assert "2 ≤ n+1 ≤ 32,767, `RELAY_FRAMES`" in text and calls.RELAY_FRAMES == 32767
    with pytest.raises(calls.LocalProtocolError):  # the lower bound: a target and a frame
        calls.pack_relayed([b"*"])
    assert "top bit (0x8000)" in text and calls._DEFLATED == 0x8000


def test_extension_size_limits_as_stated(spec: str) -> None:
    """§16.3's numbers are protocol/bitmask.py's."""
    text = squash(section(spec, "### 16.3", "### 16.4"))
    assert f"{bitmask.DEFLATE_MIN} bytes of fresh rows, `DEFLATE_MIN`" in text
    assert f"at most {bitmask.DEFLATE_MAX >> 10} KiB (`DEFLATE_MAX`)" in text
    assert bitmask.MAX_INFLATED == 1 << 28 and "2^28 bytes (`MAX_INFLATED`)" in text


def test_resend_intervals_as_stated(spec: str) -> None:
    """§16's repeat and quiet intervals of ``N`` are the rank's and the executor's."""
    from engine_side.vllm.resend import RESEND_QUIET_S
    from protocol import calls

    text = squash(spec)
    assert calls.ASK_AGAIN_S == 1.0 and "(again every second while none comes)" in text
    assert f"less than {RESEND_QUIET_S:g} s before MAY be dropped" in text


def test_multimodal_item_depth_as_stated(spec: str) -> None:
    """§7.5's nesting bound is the one both adapters hold to."""
    pytest.importorskip("vllm")
    from engine_side.vllm import mm as engine_mm
    from worker_side.vllm import mm as worker_mm

    text = squash(section(spec, "### 7.5", "### 7.6"))
    assert f"nest at most {engine_mm.MAX_DEPTH} deep" in text
    assert engine_mm.MAX_DEPTH == worker_mm.MAX_DEPTH


# -- the checkers notice an edited text ------------------------------------------------------
MUTATIONS = [
    (DeltaBody, "#### DeltaBody", "| `sd` | schedule_drop |", "| `sx` | schedule_drop |"),
    (DeltaBody, "#### DeltaBody", "| `sa` | schedule_append | packed |",
     "| `sa` | schedule_append | array of int |"),
    (RareBody, "#### RareBody", "| `ns` | num_spec_tokens_to_schedule | int | 0 |",
     "| `ns` | num_spec_tokens_to_schedule | int | 1 |"),
    (ext.StepExt, "#### StepExt", "| `tt` | total | int | -1 |", "| `tt` | total | int | 0 |"),
    (ext.StepExt, "#### StepExt", "| `pf` | prefill | array of (TokenRef or nil) |",
     "| `pf` | prefill | array of TokenRef or nil |"),
    (ext.ReplyMsg, "#### ReplyMsg", "| `z` | none | bool | false | the output is None "
     "(then no other field but `q`) |\n", ""),
    (bitmask.RowRefs, "#### RowRefs", "| 2 | table |", "| 2 | tables |"),
    (Hello, "#### Hello (tag 1)", "| 3 | major | int | 3 |", "| 3 | major | int | 2 |"),
    (wire.Spec, "#### Spec", "| `pn` | prompt_none |",
     "| `px` | prefix | int | 0 | a field the code lacks |\n| `pn` | prompt_none |"),
]


@pytest.mark.parametrize(("cls", "anchor", "old", "new"), MUTATIONS,
                         ids=[f"{m[0].__name__}:{m[2][:24]}" for m in MUTATIONS])
def test_field_table_checker_notices_an_edit(spec: str, cls: type[msgspec.Struct],
                                             anchor: str, old: str, new: str) -> None:
    assert struct_table_problems(edit_table(spec, anchor, old, new), cls) != []


def test_transition_checker_notices_an_edit(spec: str) -> None:
    edited = edit_table(spec, TRANSITION_HEADER, "| desynced | delta_in_order | apply | synced |",
                   "| desynced | delta_in_order | buffer | desynced |")
    assert transition_problems(edited) != []
    dropped = edit_table(spec, TRANSITION_HEADER, "| closed | hello | check_hello | closed |\n", "")
    assert transition_problems(dropped) != []
