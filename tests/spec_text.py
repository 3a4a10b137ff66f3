"""Reading SPEC.md: its tables, sections and §5's digest text (for the test_spec_* modules).

The checkers return their findings (lists of differences), so the tests can show that
each one notices an edited copy of the text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from protocol import digest as dg

SPEC_PATH = Path(__file__).resolve().parent.parent / "SPEC.md"
TRANSITION_HEADER = "| State | Input | Action | Next state |"
CATALOGUE_HEADER = "| Tag | Name | Direction | Purpose |"
MASK64 = (1 << 64) - 1

Row = list[str]


def read_spec() -> str:
    return SPEC_PATH.read_text(encoding="utf-8")


# -- reading the text ----------------------------------------------------------------------
def _cells(line: str) -> Row:
    """A table line's cells, outer backticks stripped (``\\|`` is a literal bar)."""
    parts = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().strip("`").strip().replace("\\|", "|") for c in parts]


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


def section(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


def squash(text: str) -> str:
    """Whitespace runs as one space (prose wraps anywhere)."""
    return " ".join(text.split())


def edit_table(text: str, anchor: str, old: str, new: str) -> str:
    """``text`` with ``old`` replaced by ``new`` once, in the table after ``anchor``."""
    at = text.index(anchor)
    end = text.index("\n\n", text.index("| ---", at)) + 1  # (the last row's newline)
    part = text[at:end]
    assert part.count(old) == 1, (anchor, old)
    return text[:at] + part.replace(old, new) + text[end:]


# -- §5: constants and the definition, recomputed from the text ----------------------------
FORMULA = """\
digest = Σ_h spec(h) + Σ_h computed(h) + Σ_{h,g,i} block(h,g,i)
       + Σ_{h,i} token(h,i) + Σ_{i} sched(i)                     (mod 2^64)

spec(h)       = mix64(B(h) XOR (h * K_SPEC))
computed(h)   = computed_h * key(h)          where key(h) = mix64(h * K_COMP + K_HANDLE) OR 1
block(h,g,i)  = mix64(blocks[g]_h[i] * K_SPEC + i * K_POS + h * K_HANDLE + g * K_GROUP + K_ROW)
token(h,i)    = mix64(tokens_h[i] * K_TOKEN + i * K_POS + h * K_SPEC + K_ROW)
sched(i)      = (count[i] + 1) * skey(i)    where skey(i) = """ \
    """mix64(schedule[i] * K_SCHED + i * K_POS) OR 1
"""
MIX64 = """\
mix64(z): z ^= z >> 30; z *= 0xBF58476D1CE4E5B9;
          z ^= z >> 27; z *= 0x94D049BB133111EB;
          z ^= z >> 31; return z
"""


def text_constants(text: str) -> dict[str, int]:
    body = section(text, "## 5. Digest", "## 6.")
    return {k: int(v, 16) for k, v in re.findall(r"`(K_[A-Z]+) = (0x[0-9A-Fa-f]+)`", body)}


def text_mix64(text: str) -> Any:
    """§5's ``mix64``, its multipliers read from the text."""
    body = section(text, "## 5. Digest", "## 6.")
    m1, m2 = (int(x, 16) for x in re.findall(r"z \*= (0x[0-9A-Fa-f]+)", body))

    def mix64(z: int) -> int:
        z &= MASK64
        z ^= z >> 30
        z = (z * m1) & MASK64
        z ^= z >> 27
        z = (z * m2) & MASK64
        return z ^ (z >> 31)

    return mix64


def digest_text_problems(text: str) -> list[str]:
    body = section(text, "## 5. Digest", "## 6.")
    out = []
    if FORMULA not in body:
        out.append("§5's formulas are not the ones this test implements")
    if MIX64 not in body:
        out.append("§5's mix64 is not the one this test implements")
    code = {k: int(v) for k, v in vars(dg).items() if re.fullmatch(r"K_[A-Z]+", k)}
    if text_constants(text) != code:
        out.append(f"constants: text {text_constants(text)}, code {code}")
    if "hashlib.blake2b(data, digest_size=8)" not in body:
        out.append("B(h) is not stated as hashlib.blake2b(data, digest_size=8)")
    return out
