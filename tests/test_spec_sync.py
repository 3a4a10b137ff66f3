"""SPEC.md and the code must say the same thing.

The normative tables of SPEC.md are parsed and compared, in both directions,
with the tables the code runs on: the replica transition table, the message
tags, the body short keys, the message field positions, the digest constants
and the tensor dtype codes.  (h11 renders its state diagram from its table for
the same reason.)  The §5 digest is recomputed from its written definition, and
the §14 worked example is replayed so its printed bytes stay real.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest

from engine_side.mirror import EngineMirror
from protocol import digest as dg
from protocol import tensors
from protocol.codec import encode
from protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_MAJOR,
    PROTOCOL_MINOR,
    DeltaBody,
    NewRequest,
    Rows,
    SnapshotBody,
)
from protocol.params import SamplingSpec
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec
from protocol.state import ReplicaState
from worker_side.replica import TRANSITIONS, Action, Input, State

SPEC_PATH = Path(__file__).resolve().parent.parent / "SPEC.md"
TRANSITION_HEADER = "| State | Input | Action | Next state |"
CATALOGUE_HEADER = "| Tag | Name | Direction | Purpose |"

Row = list[str]


@pytest.fixture(scope="module")
def spec() -> str:
    return SPEC_PATH.read_text(encoding="utf-8")


def _cells(line: str) -> Row:
    return [c.strip().strip("`").strip() for c in line.strip().strip("|").split("|")]


def table_at(text: str, anchor: str) -> tuple[Row, list[Row]]:
    """(header, rows) of the first markdown table at or after the line ``anchor``."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == anchor]
    assert len(starts) == 1, f"SPEC.md must contain the line {anchor!r} exactly once"
    i = starts[0]
    while not lines[i].startswith("|"):
        i += 1
    header = _cells(lines[i])
    assert set(lines[i + 1].replace("|", "").strip()) <= set("-: "), "missing separator row"
    rows = []
    for line in lines[i + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(_cells(line))
    assert all(len(r) == len(header) for r in rows), f"ragged table after {anchor!r}"
    return header, rows


def test_transition_table_equals_code(spec: str) -> None:
    _, rows = table_at(spec, TRANSITION_HEADER)
    parsed = {(State(s), Input(i)): (Action(a), State(n)) for s, i, a, n in rows}
    assert len(parsed) == len(rows), "SPEC.md lists a (state, input) pair twice"
    assert parsed == TRANSITIONS


def test_transition_table_follows_code_order(spec: str) -> None:
    _, rows = table_at(spec, TRANSITION_HEADER)
    expected = [[s.value, i.value, a.value, n.value] for (s, i), (a, n) in TRANSITIONS.items()]
    assert rows == expected


def test_missing_pairs_are_listed(spec: str) -> None:
    match = re.search(r"Intentionally missing:(.*?)\n\n", spec, re.S)
    assert match is not None, "SPEC.md must list the intentionally missing pairs"
    listed = {(State(s), Input(i)) for s, i in re.findall(r"\(`(\w+)`, `(\w+)`\)", match.group(1))}
    missing = {(s, i) for s in State for i in Input} - TRANSITIONS.keys()
    assert listed == missing


def test_message_catalogue_tags(spec: str) -> None:
    _, rows = table_at(spec, CATALOGUE_HEADER)
    parsed = {name: int(tag) for tag, name, _, _ in rows}
    assert len(parsed) == len(rows)
    assert parsed == {cls.__name__: cls.__struct_config__.tag for cls in MESSAGE_TYPES}


@pytest.mark.parametrize(
    "body", [DeltaBody, NewRequest, Rows, SnapshotBody], ids=lambda c: c.__name__
)
def test_body_keys(spec: str, body: type[msgspec.Struct]) -> None:
    header, rows = table_at(spec, f"#### {body.__name__}")
    assert header[:2] == ["Key", "Field"]
    parsed = {r[0]: r[1] for r in rows}
    assert len(parsed) == len(rows), f"{body.__name__}: a key is listed twice"
    code = {f.encode_name: f.name for f in msgspec.structs.fields(body)}
    assert parsed == code


def test_deltabody_every_short_key_documented(spec: str) -> None:
    _, rows = table_at(spec, "#### DeltaBody")
    keys = {r[0] for r in rows}
    for f in msgspec.structs.fields(DeltaBody):
        assert f.encode_name in keys, f"DeltaBody.{f.name} ({f.encode_name!r}) not in SPEC.md"


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_message_field_positions(spec: str, cls: type[msgspec.Struct]) -> None:
    _, common = table_at(spec, "Common header (all messages):")
    assert [r[:2] for r in common] == [["0", "tag"], ["1", "epoch"], ["2", "seq"]]
    _, rows = table_at(spec, f"#### {cls.__name__} (tag {cls.__struct_config__.tag})")
    fields = [f.name for f in msgspec.structs.fields(cls)]
    assert fields[:2] == ["epoch", "seq"]
    # position 0 is the tag, so field i of the Struct sits at position i + 1
    assert [(int(r[0]), r[1]) for r in rows] == [(i + 1, f) for i, f in enumerate(fields)][2:]


def test_version_header(spec: str) -> None:
    match = re.search(r"^\* Version: (\d+)\.(\d+)", spec, re.M)
    assert match is not None
    assert (int(match.group(1)), int(match.group(2))) == (PROTOCOL_MAJOR, PROTOCOL_MINOR)


def test_digest_constants(spec: str) -> None:
    section = spec[spec.index("## 5. Digest") : spec.index("## 6.")]
    named = dict(re.findall(r"`(K_[A-Z]+) = (0x[0-9A-F]+)`", section))
    code = {
        name.lstrip("_"): hex(int(getattr(dg, name))) for name in dir(dg) if name.startswith("_K_")
    }
    assert {k: hex(int(v, 16)) for k, v in named.items()} == code
    # the splitmix64 multipliers: checked by value on a few inputs
    for x in (0, 1, 2**63 + 12345, 2**64 - 1):
        z = x
        z ^= z >> 30
        z = (z * 0xBF58476D1CE4E5B9) & dg.MASK
        z ^= z >> 27
        z = (z * 0x94D049BB133111EB) & dg.MASK
        z ^= z >> 31
        assert int(dg.mix64(x)[0]) == z
    assert "0xBF58476D1CE4E5B9" in section and "0x94D049BB133111EB" in section


def test_dtype_codes(spec: str) -> None:
    start = spec.index("Dtype codes (never reassigned):")
    paragraph = spec[start : spec.index("\n\n", start)]
    parsed = {int(code): name for code, name in re.findall(r"(\d+)\s+(bool|[a-z]+\d+)", paragraph)}
    assert parsed == tensors._DTYPES


# -- §5 and §14 recomputed from the text's own definitions -------------------------------

_MASK = (1 << 64) - 1


def _mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & _MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _spec_digest(state: ReplicaState) -> int:
    """The digest exactly as SPEC.md §5 writes it (plain Python ints, no numpy)."""
    k = {name.lstrip("_"): int(getattr(dg, name)) for name in dir(dg) if name.startswith("_K_")}
    total = 0
    for h in state.live_handles().tolist():
        spec = state.handle_of(h)
        meta = [
            spec.req_id,
            spec.sampling,
            spec.pooling,
            spec.lora,
            [[f.modality, f.identifier, f.offset, f.length, f.mm_hash] for f in spec.mm_features],
            spec.prompt_is_token_ids,
            spec.prompt_token_ids is None,
        ]
        prompt = b"" if spec.prompt_token_ids is None else spec.prompt_token_ids.astype("<i8")
        data = msgspec.msgpack.encode(meta) + bytes(prompt)
        spec_hash = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        total += _mix64(spec_hash ^ (h * k["K_SPEC"] & _MASK))
        key = _mix64((h * k["K_COMP"] + k["K_HANDLE"]) & _MASK) | 1
        total += int(state.cols.computed[h]) * key
        for g in range(state.kv_groups):
            for i, b in enumerate(state.blocks[g][h].tolist()):
                total += _mix64(
                    (b * k["K_SPEC"] + i * k["K_POS"] + h * k["K_HANDLE"] + g * k["K_GROUP"])
                    & _MASK
                )
    for i, (h, n) in enumerate(zip(state.schedule.tolist(), state.nsched.tolist(), strict=True)):
        total += (n + 1) * (_mix64((h * k["K_SCHED"] + i * k["K_POS"]) & _MASK) | 1)
    return total & _MASK


def _worked_example() -> tuple[EngineMirror, list[bytes]]:
    """§14's engine side: two requests, prefill, then decode steps 2..8."""
    specs = [
        RequestSpec("a", np.arange(100, 110, dtype=np.int64), SamplingSpec(temperature=0.0)),
        RequestSpec("b", np.arange(200, 206, dtype=np.int64), SamplingSpec(max_tokens=64)),
    ]
    mirror = EngineMirror(epoch=7, verify=True)
    frames = []
    for step in range(1, 9):
        counts = [10, 6] if step == 1 else [1, 1]
        computed = [0, 0] if step == 1 else [8 + step, 4 + step]
        tables = [[5, 6] if step == 8 else [5], [9]]
        request = ExecuteModelRequest(
            ["a", "b"],
            specs,
            np.array(counts, dtype=np.int64),
            np.array(computed, dtype=np.int64),
            (Ragged.from_lists(tables),),
            Ragged.empty(2),
            Ragged.empty(2),
        )
        frames.append(b"".join(bytes(f) for f in encode(mirror.diff(request))))
    return mirror, frames


def test_digest_definition_matches_code() -> None:
    mirror, _ = _worked_example()
    assert _spec_digest(mirror.state) == mirror.state.digest == mirror.state.recompute_digest()


def test_worked_example_bytes(spec: str) -> None:
    mirror, frames = _worked_example()
    section = spec[spec.index("## 14. Worked example") : spec.index("## 15.")]
    for step, size in ((1, 130), (2, 32), (3, 14), (8, 32)):
        assert len(frames[step - 1]) == size
        assert f"Delta seq {step}, " in section and f"{size} B" in section
    for step in (2, 3):  # printed in full
        assert f"`{frames[step - 1].hex(' ')}`" in section
    assert f"`{mirror.state.digest:#018x}`" in section


def test_local_ring_layout_and_record_kinds_match_the_code(spec: str) -> None:
    """§7.6's segment table and record kinds are the ones worker_side/ring.py uses."""
    from worker_side import ring

    _, rows = table_at(spec, "| Word | Name | Written by | Meaning |")
    words = {name: word for word, name, *_ in rows}
    fixed = {"magic": ring._W_MAGIC, "version": ring._W_VERSION, "ring_bytes": ring._W_RING,
             "ranks": ring._W_RANKS, "reply_bytes": ring._W_REPLY, "closed": ring._W_CLOSED,
             "head": ring._W_HEAD}
    assert {k: int(words[k]) for k in fixed} == fixed
    layout = ring.Layout(1024, 1024)
    assert words["sleeping[r]"] == f"{ring._HEADER_WORDS} + r" \
        and ring._sleeping_word(5) == ring._HEADER_WORDS + 5
    assert words["reply_head[r]"] == f"{ring._HEADER_WORDS} + R + r" \
        and layout.reply_word(5) == ring._HEADER_WORDS + layout.ranks + 5
    assert layout.ranks == ring.MAX_RANKS == 64 and "`R` = 64" in spec
    meaning = {name: row[-1] for _, name, *row in rows}
    assert f"{ring.MAGIC:#x}".lower() in meaning["magic"].lower()
    assert meaning["version"] == str(ring.VERSION)
    _, records = table_at(spec, "| Bytes | Field | Meaning |")
    kinds = dict(re.findall(r"(\d) `?([A-Z_]+)", records[1][2]))  # (cells lose end backticks)
    assert kinds == {str(ring.MESSAGE): "MESSAGE", str(ring.ON_PUB): "ON_PUB",
                     str(ring.WRAP): "WRAP"}


@pytest.mark.parametrize("name", ["rows", "sparse"])
def test_grammar_bitmask_structs_match_their_spec_field_lists(spec: str, name: str) -> None:
    """§16 lists the fields of the GrammarMsg's `rows` and `sparse` in wire order."""
    pytest.importorskip("vllm")
    from engine_side.vllm.schema import GrammarMsg, RowRefs, SparseWords

    found = re.findall(rf"`{name} = \[([a-z_, ]+)\]`", spec)
    assert len(found) == 1, f"SPEC.md must list `{name} = [...]` once"
    struct = {"rows": RowRefs, "sparse": SparseWords}[name]
    assert [f.strip() for f in found[0].split(",")] == list(struct.__struct_fields__)
    assert name in GrammarMsg.__struct_fields__
