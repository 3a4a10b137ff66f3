"""Why a recorded workload costs what it costs: the figures behind BENCHMARKS' verdicts.

``python -m engine_side.bench.vllm_diagnose /tmp/vllm-streams/*.dcrec`` prints one JSON
object per recording: bytes per new request by NewRequest key, sampling-spec bytes spent
on values equal to their defaults (msgspec's ``omit_defaults`` compares floats by
identity), grammar-bitmask sparsity and compressibility, draft-token counts, and steady
decode steps over 32 B + 4 per new block grouped by their number of new blocks.
"""

from __future__ import annotations

import json
import sys
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from engine_side.bench.vllm_replay import is_steady, load_recording, new_blocks
from engine_side.report.accounting import field_sizes


def default_waste(spec: msgspec.Struct, enc: msgspec.msgpack.Encoder) -> int:
    """Bytes ``spec`` spends on fields equal (same type and value) to their default."""
    same = {}
    for f in msgspec.structs.fields(spec):
        value = getattr(spec, f.name)
        if f.default is not msgspec.NODEFAULT and type(value) is type(f.default) \
                and value == f.default:
            same[f.name] = f.default
    return len(enc.encode(spec)) - len(enc.encode(msgspec.structs.replace(spec, **same)))


class _Stats:
    def __init__(self) -> None:
        self.adds, self.add_keys, self.waste = 0, Counter[str](), 0
        self.steady, self.over = Counter[int](), Counter[int]()
        self.bitmask = Counter[str]()
        self.drafts = Counter[str]()

    def execute(self, so: Any, frames: list[bytes], prev: dict[str, int],
                enc: msgspec.msgpack.Encoder) -> None:
        from protocol import codec
        from protocol.messages import Delta

        msg = codec.decode(frames)
        for add in msg.body.added if isinstance(msg, Delta) else ():
            self.adds += 1
            self.add_keys.update(field_sizes(add))
            if add.sampling is not None:
                self.waste += default_waste(add.sampling, enc)
        if is_steady(so, prev):
            blocks = new_blocks(so)
            self.steady[blocks] += 1
            self.over[blocks] += sum(map(len, frames)) - 4 * blocks > 32
        for drafts in so.scheduled_spec_decode_tokens.values():
            self.drafts.update(tokens=len(drafts), rows=1)

    def grammar(self, grammar: Any) -> None:
        mask = np.ascontiguousarray(grammar.grammar_bitmask)
        words = mask.ravel()
        self.bitmask.update(bytes=mask.nbytes, zlib1=len(zlib.compress(mask.tobytes(), 1)),
                            words=words.size, zero_words=int((words == 0).sum()),
                            ones_words=int((words == -1).sum()), rows=mask.shape[0])

    def report(self) -> dict[str, Any]:
        n = max(1, self.adds)
        return {"new_requests": self.adds,
                "new_request_bytes_per_key": {k: round(v / n, 1)
                                              for k, v in self.add_keys.most_common()},
                "sampling_default_bytes": self.waste,
                "steady_by_new_blocks": {b: [self.steady[b], self.over[b]]
                                         for b in sorted(self.steady)},
                "bitmask": dict(self.bitmask), "drafts": dict(self.drafts)}


def diagnose(path: Path) -> dict[str, Any]:
    """The figures for one recording (``steady_by_new_blocks``: blocks → [steps, over])."""
    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from protocol.tensors import make_enc_hook

    enc, sizer = SchedulerOutputEncoder(), msgspec.msgpack.Encoder(enc_hook=make_enc_hook([]))
    stats, prev = _Stats(), dict[str, int]()
    for kind, obj in load_recording(path):
        if kind == "execute_model":
            stats.execute(obj, [bytes(f) for f in enc.encode(obj)], prev, sizer)
            prev = dict(obj.num_scheduled_tokens)
        elif kind == "sample_tokens" and obj is not None:
            stats.grammar(obj)
    return {"recording": path.stem, **stats.report()}


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(json.dumps(diagnose(Path(arg))))
