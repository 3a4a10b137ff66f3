"""``deltacast record``: write the step stream of a vLLM run to a file, never as pickle.

File format (all integers little-endian)::

    magic     16 bytes  b"DELTACAST-REC\\x00\\x02\\n" (format version 2 in byte 14)
    header    u32 length + msgpack RecordHeader
    records   u8 kind, u16 frame count, then per frame u32 length + bytes

A record's frames are exactly what the adapter sends on that channel: a
``execute_model`` record is one Delta message (``codec.encode``), ``sample_tokens``
a GrammarOutput message, ``reply`` a ModelRunnerOutput message.  Replaying the
records through a fresh ``SchedulerOutputDecoder`` rebuilds the run's
SchedulerOutputs exactly.  The reader checks the magic first and raises
:class:`NotARecording` for any other file: nothing in a file is ever unpickled
(sealed connector metadata stays sealed unless its secret is supplied).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from protocol.recording import (  # noqa: E402,F401  (the format lives in the pure layer)
    KINDS,
    MAGIC,
    NotARecording,
    RecordHeader,
    RecordReader,
    RecordWriter,
)

# ---------------------------------------------------------------- recording a live executor
StepHook = Callable[[str, Any, Any], None]


class Recorder:
    """Wraps an executor's ``execute_model`` / ``sample_tokens`` to record every message.

    Each message is encoded (engine side), written, and decoded again by a
    worker-side decoder (which also encodes the replies, as a worker would).
    ``on_step(kind, original, decoded)`` may compare the two; ``stats`` holds one
    ``(kind, bytes, encode_s, decode_s)`` row per message.  Calls run blocking
    (the CPU platform has no async scheduling); a Future is returned when asked.
    """

    def __init__(self, writer: RecordWriter | None, encoder: Any, decoder: Any,
                 on_step: StepHook | None = None) -> None:
        self.writer, self.encoder, self.decoder, self.on_step = writer, encoder, decoder, on_step
        self.stats: list[tuple[str, int, float, float]] = []

    def _message(self, kind: str, obj: Any, encode: Callable[[Any], list[Any]],
                 decode: Callable[[list[Any]], Any]) -> None:
        t0 = time.perf_counter()
        frames = encode(obj)
        t1 = time.perf_counter()
        wire = [bytes(f) for f in frames]
        t2 = time.perf_counter()
        decoded = decode(wire)
        t3 = time.perf_counter()
        self.stats.append((kind, sum(len(f) for f in wire), t1 - t0, t3 - t2))
        if self.writer is not None:
            self.writer.write(kind, wire)
        if self.on_step is not None:
            self.on_step(kind, obj, decoded)

    def _reply(self, kind: str, result: Any, non_block: bool) -> Any:
        if isinstance(result, Future):
            result = result.result()
        self._message(kind, result, self.decoder.encode_reply, self.encoder.decode_reply)
        if not non_block:
            return result
        fut: Future[Any] = Future()
        fut.set_result(result)
        return fut

    def install(self, executor: Any) -> None:
        original_execute, original_sample = executor.execute_model, executor.sample_tokens

        def execute_model(scheduler_output: Any, non_block: bool = False) -> Any:
            self._message("execute_model", scheduler_output, self.encoder.encode,
                          self.decoder.decode)
            return self._reply("reply", original_execute(scheduler_output, non_block=False),
                               non_block)

        def sample_tokens(grammar_output: Any, non_block: bool = False) -> Any:
            self._message("sample_tokens", grammar_output, self.encoder.encode_grammar,
                          self.decoder.decode_grammar)
            return self._reply("sample_reply", original_sample(grammar_output, non_block=False),
                               non_block)

        executor.execute_model = execute_model
        executor.sample_tokens = sample_tokens


def engine_executor(llm: Any) -> Any:
    """The in-process executor of an ``LLM`` built with VLLM_ENABLE_V1_MULTIPROCESSING=0."""
    return llm.llm_engine.engine_core.engine_core.model_executor


# ---------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model path or name")
    parser.add_argument("--prompts", required=True, help="text file, one prompt per line")
    parser.add_argument("--out", required=True, help="recording file to write")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--enable-prefix-caching", action="store_true")


def run(args: argparse.Namespace) -> int:
    """Run ``LLM.generate`` in this process, recording every step; outputs are unchanged."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm
    from vllm import LLM, SamplingParams

    from engine_side.vllm.encoder import SchedulerOutputEncoder
    from worker_side.vllm.decoder import SchedulerOutputDecoder

    prompts = [p for p in Path(args.prompts).read_text().splitlines() if p.strip()]
    extra = {} if args.block_size is None else {"block_size": args.block_size}
    llm = LLM(model=args.model, max_model_len=args.max_model_len, enforce_eager=True,
              enable_prefix_caching=args.enable_prefix_caching, **extra)
    with RecordWriter(args.out, meta={"model": str(args.model)},
                      vllm_version=vllm.__version__) as writer:
        Recorder(writer, SchedulerOutputEncoder(), SchedulerOutputDecoder()).install(
            engine_executor(llm))
        outs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens,
                                                    temperature=args.temperature))
    print(f"recorded {len(outs)} requests to {args.out}")
    return 0
