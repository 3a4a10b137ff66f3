"""The vLLM adapter's frames of the golden corpus, pinned: protocol major 3 on the wire.

Every golden vLLM stream (``tests/golden/streams``) is encoded by the adapter --
SchedulerOutputs and GrammarOutputs by the engine's encoder, replies by a rank's
decoder, the same per-run secret -- and the SHA-256 of every frame, each preceded by
its length, must equal the value pinned in ``tests/golden/frames.json`` (with the
total bytes, so a change says how much it moved).  A change of any byte the adapter
sends fails here; the decoded objects are checked by ``test_golden_streams.py``.
Regenerate after an intended wire change, and say so in the commit::

    .venv/bin/python tests/test_golden_frames.py --write
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

PINNED = Path(__file__).resolve().parent / "golden" / "frames.json"
SECRET = b"k" * 32


def stream_frames(records: list[tuple[str, Any]]) -> tuple[str, int]:
    """(SHA-256 hex of every frame with its length, total bytes) of one stream."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    enc, dec = SchedulerOutputEncoder(secret=SECRET), SchedulerOutputDecoder(secret=SECRET)
    digest, total = hashlib.sha256(), 0
    for kind, obj in records:
        if kind == "execute_model":
            frames = enc.encode(obj)
            dec.decode(frames)
        elif kind == "sample_tokens":
            frames = enc.encode_grammar(obj)
            dec.decode_grammar(frames)
        else:
            frames = dec.encode_reply(obj)
            enc.decode_reply(frames)
        for f in frames:
            data = bytes(f)
            digest.update(len(data).to_bytes(8, "little"))
            digest.update(data)
            total += len(data)
    return digest.hexdigest(), total


def current() -> dict[str, dict[str, Any]]:
    from golden_streams import golden_streams

    out = {}
    for name, (_, records) in sorted(golden_streams().items()):
        sha, size = stream_frames(records)
        out[name] = {"sha256": sha, "bytes": size, "records": len(records)}
    return out


@pytest.mark.vllm
def test_the_adapters_frames_are_the_pinned_ones() -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed")
    pinned = json.loads(PINNED.read_text())
    got = current()
    assert got.keys() == pinned.keys()
    moved = {name: (pinned[name]["bytes"], got[name]["bytes"]) for name in got
             if got[name] != pinned[name]}
    assert not moved, f"frames changed (pinned bytes, now bytes): {moved}"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: test_golden_frames.py --write")
    PINNED.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {PINNED}")
