"""Golden wire bytes of protocol major 3: one fixed instance of every message type,
frozen tags, stable digests.

Each ``tests/golden/<name>.hex`` holds one encoded message, one frame per line in
hex (frame 0 is the msgpack body, later lines are tensor frames).  The test fails if
any byte differs: that means the wire format (or the digest function) changed, a
protocol change -- bump the version or fix the regression.  The tests never write
the fixtures; to accept an intended change, regenerate them with
:func:`write_golden` and review the diff::

    cd tests && ../.venv/bin/python -c "import test_golden as g; g.write_golden()"

The instances come from a fixed engine workload (``golden_messages``), so the
Delta and Snapshot fixtures also pin the handle allocation, the diffing choices
and the 64-bit digest.
"""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from oracle import Oracle

from engine_side.mirror import EngineMirror
from engine_side.request_diff import RequestDiffer
from protocol import codec
from protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_MAJOR,
    CheckIn,
    Delta,
    DeltaBody,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    NewRequest,
    Snapshot,
    SnapshotRequest,
    Spec,
    encode_spec,
)
from protocol.params import SamplingSpec
from protocol.request import ExecuteModelRequest, Ragged, RequestSpec

GOLDEN = Path(__file__).parent / "golden"
FROZEN_TAGS = {Hello: 1, Goodbye: 2, Heartbeat: 3, Delta: 4, Snapshot: 5, CheckIn: 6,
               SnapshotRequest: 7}


def _spec(req_id: str, prompt: list[int] | None, **sampling: object) -> RequestSpec:
    tokens = None if prompt is None else np.array(prompt, dtype=np.int64)
    embeds = None
    if prompt is None:  # prompt embeddings travel as a tensor frame (numpy: no torch import)
        embeds = (np.arange(12, dtype=np.float16) / 8).reshape(3, 4)
    return RequestSpec(req_id, tokens, SamplingSpec(**sampling), prompt_embeds=embeds)  # type: ignore[arg-type]


SPECS = {
    "a": _spec("a", list(range(100, 120)), temperature=0.5),
    "b": _spec("b", [7, 8, 9], max_tokens=64, seed=3),
    "c": _spec("c", list(range(100, 116)) + [1, 2, 3], top_k=40),
    "e": _spec("e", None),
}


def _step(rows: list[tuple[str, int, int, list[int]]], finished: tuple[str, ...] = (),
          preempted: tuple[str, ...] = (), spec_tokens: list[list[int]] | None = None
          ) -> ExecuteModelRequest:
    """One step from (id, scheduled, computed, block table) rows in batch order."""
    n = len(rows)
    return ExecuteModelRequest(
        req_ids=[r[0] for r in rows], specs=[SPECS[r[0]] for r in rows],
        num_scheduled_tokens=np.array([r[1] for r in rows], dtype=np.int64),
        num_computed_tokens=np.array([r[2] for r in rows], dtype=np.int64),
        block_tables=(Ragged.from_lists([r[3] for r in rows]),),
        spec_token_ids=Ragged.from_lists(spec_tokens) if spec_tokens else Ragged.empty(n),
        encoder_inputs=Ragged.empty(n), finished_req_ids=frozenset(finished),
        preempted_req_ids=frozenset(preempted),
    )


def golden_steps() -> list[ExecuteModelRequest]:
    """A fixed workload: prefill, a busy step (an unknown finish, a join, a preemption,
    drafts), then finishes and a join with prompt embeddings."""
    return [
        _step([("a", 20, 0, [1, 2]), ("b", 3, 0, [3])]),
        _step([("a", 2, 20, [1, 2, 5]), ("c", 3, 16, [6, 7])], finished=("x-unknown",),
              preempted=("b",), spec_tokens=[[11], []]),
        _step([("a", 1, 22, [1, 2, 5]), ("e", 3, 0, [8])], finished=("b", "c")),
    ]


@functools.cache
def golden_messages() -> dict[str, Message]:
    oracle = Oracle(epoch=7)  # every step checked: the mirror's state rebuilds it
    deltas = [oracle.diff(step) for step in golden_steps()]
    mirror = oracle.mirror
    assert len(mirror.snapshot().body.requests) == 2
    return {
        "hello": Hello(epoch=7, seq=0, role="engine", config="cfg-0123", version="3.0.0"),
        "goodbye": Goodbye(epoch=7, seq=3, reason="shutdown"),
        "heartbeat": Heartbeat(*mirror.heartbeat_fields()),
        "delta": deltas[1],
        "snapshot": mirror.snapshot(),
        "checkin": CheckIn(epoch=7, seq=3, rank=1, state="synced", token_hash=2**64 - 2,
                           token_hash_seq=2, pid=4242),
        "snapshot_request": SnapshotRequest(epoch=7, seq=-1, rank=2),
        "delta_bf16": _bf16_delta(),
    }


def _bf16_delta() -> Delta:
    """A torch bf16 tensor inside an add: pins the tensor Ext header and raw bf16 bits."""
    import torch

    embeds = (torch.arange(-3, 3, dtype=torch.float32) / 4).to(torch.bfloat16).reshape(2, 3)
    spec = encode_spec(Spec(req_id="t", prompt_none=True, embeds=("bfloat16", (3, 2))))
    add = NewRequest(handle=0, spec=spec, embeds=embeds.t())
    return Delta(epoch=7, seq=1, digest=0, body=DeltaBody(added=(add,)))


def _frames_hex(msg: Message) -> str:
    return "".join(bytes(f).hex() + "\n" for f in codec.encode(msg))


NAMES = ["hello", "goodbye", "heartbeat", "delta", "snapshot", "checkin", "snapshot_request",
         "delta_bf16"]  # fixture files; listed so collection does not import torch


def write_golden() -> None:
    """Rewrite every fixture from the current code (run by hand, never by a test)."""
    for name, msg in golden_messages().items():
        (GOLDEN / f"{name}.hex").write_text(_frames_hex(msg))


@pytest.mark.parametrize("name", NAMES)
def test_encoding_matches_fixture(name: str) -> None:
    msg = golden_messages()[name]
    path = GOLDEN / f"{name}.hex"
    assert _frames_hex(msg) == path.read_text(), f"wire bytes of {name} changed"
    frames = [bytes.fromhex(line) for line in path.read_text().splitlines()]
    assert _frames_hex(codec.decode(frames)) == path.read_text()  # and the fixture decodes


def test_the_fixtures_speak_major_3() -> None:
    """The Hello fixture offers PROTOCOL_MAJOR 3: the fixtures are major 3's bytes."""
    assert PROTOCOL_MAJOR == 3
    hello = codec.decode([bytes.fromhex((GOLDEN / "hello.hex").read_text().split()[0])])
    assert isinstance(hello, Hello) and hello.major == 3


def test_every_message_type_has_a_fixture() -> None:
    assert list(golden_messages()) == NAMES
    assert {type(m) for m in golden_messages().values()} == set(MESSAGE_TYPES)
    assert len(codec.encode(golden_messages()["delta_bf16"])) == 2
    delta = golden_messages()["delta"]
    assert isinstance(delta, Delta) and delta.body.added and delta.body.rare.finished_unknown
    assert delta.body.rare.preempted and delta.body.spec_tokens is not None
    snapshot = golden_messages()["snapshot"]
    assert isinstance(snapshot, Snapshot) and len(codec.encode(snapshot)) == 2  # embeds frame


def test_tags_are_frozen_and_unique() -> None:
    tags = {cls: cls.__struct_config__.tag for cls in MESSAGE_TYPES}
    assert tags == FROZEN_TAGS
    assert len(set(tags.values())) == len(tags)
    for name, msg in golden_messages().items():
        body = bytes.fromhex((GOLDEN / f"{name}.hex").read_text().split()[0])
        assert body[1] == FROZEN_TAGS[type(msg)]  # [tag, epoch, seq, ...]: tag right after


def fingerprint() -> str:
    """Digest and hash of every frame of the golden workload (run in a subprocess too)."""
    mirror = EngineMirror(epoch=7)
    differ = RequestDiffer(mirror)
    wire = hashlib.sha256()
    for step in golden_steps():
        for frame in codec.encode(differ.diff(step)):
            wire.update(bytes(frame))
    return f"{mirror.state.digest:016x} {wire.hexdigest()}"


def test_digest_and_bytes_stable_across_hash_seeds() -> None:
    """The same steps make the same bytes in every process: nothing on the wire follows
    the iteration order of a set of strings (finished ids arrive as a frozenset; hash
    seeds 0 and 1 order {"b", "c"} apart)."""
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); " \
           "import test_golden; print(test_golden.fingerprint())"
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed})
            for seed in ("0", "1", "4242")]
    outputs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert outputs == [fingerprint()] * 3
