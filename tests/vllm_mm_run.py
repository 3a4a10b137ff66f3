"""Run by tests/test_vllm_mm_executor.py: audio and prompt embeds, default vs DeltaExecutor.

Builds a tiny random Qwen2-Audio model offline (the CPU build cannot run a
vision model here: vLLM's CLIP/SigLIP path imports transformers' pixtral image
processor, which needs torchvision), then runs vLLM's default executor and
DeltaExecutor with a shared-memory store on the same requests: two audio clips
(one sent again in a second batch: a store hit) and one ``prompt_embeds``
prompt.  A recorder installed on each worker's runner digests every
NewRequestData it receives (tensor bytes, dtypes, shapes, field classes).
Writes JSON: ``python tests/vllm_mm_run.py MODEL_DIR OUT.json``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any, cast

AUDIO_PROMPT = "the <|audio_bos|><|AUDIO|><|audio_eos|> quick brown"
HIDDEN = 128
STORE_MB = 16


def build_tiny_audio_model(path: Path) -> Path:
    """A random Qwen2-Audio (1-layer whisper encoder, 2-layer Qwen2, bf16), offline."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        AutoTokenizer,
        Qwen2AudioConfig,
        Qwen2AudioEncoderConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        Qwen2Config,
        WhisperFeatureExtractor,
    )

    from engine_side.bench.vllm_scenarios import build_tiny_model

    if (path / "config.json").exists():
        return path
    tok = AutoTokenizer.from_pretrained(build_tiny_model(path.parent / "tiny-base"))
    tok.add_special_tokens({"additional_special_tokens": ["<|AUDIO|>", "<|audio_bos|>",
                                                          "<|audio_eos|>"]})
    torch.manual_seed(0)
    audio_token = tok.convert_tokens_to_ids("<|AUDIO|>")
    assert isinstance(audio_token, int)  # one token, one id
    audio = Qwen2AudioEncoderConfig(d_model=64, encoder_layers=1, encoder_attention_heads=2,
                                    encoder_ffn_dim=128, num_mel_bins=128)
    text = Qwen2Config(hidden_size=HIDDEN, intermediate_size=256, num_attention_heads=2,
                       num_key_value_heads=2, num_hidden_layers=2, vocab_size=len(tok),
                       max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    config = Qwen2AudioConfig(audio_config=audio.to_dict(), text_config=text.to_dict(),
                              audio_token_index=audio_token, dtype="bfloat16")
    Qwen2AudioForConditionalGeneration(config).bfloat16().save_pretrained(path)
    weights = path / "model.safetensors"  # transformers 5 doubles "model." in the legacy names
    renamed = {k.replace("language_model.model.model.", "language_model.model."): v
               for k, v in load_file(weights).items()}
    save_file(renamed, weights, metadata={"format": "pt"})
    Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=128),
                        tokenizer=tok, chat_template="{{ messages }}").save_pretrained(path)
    return path


# ---------------------------------------------------------------- worker-side recorder


def _digest(obj: Any) -> Any:
    """JSON-able fingerprint: types all the way down, tensors by dtype, shape and bytes."""
    from protocol.tensors import tensor_bytes

    if type(obj).__module__.startswith("torch") and hasattr(obj, "dtype"):
        return ["tensor", str(obj.dtype), list(obj.shape),
                hashlib.sha256(tensor_bytes(obj)).hexdigest()[:16]]
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, [_digest(v) for v in obj]]
    if obj is None or isinstance(obj, (int, float, str, bool)):
        return obj
    return repr(obj)


def _feature(f: Any) -> Any:
    pos = f.mm_position
    item = None if f.data is None else [
        [k, type(e.field).__name__, repr(e.field), _digest(e.data)] for k, e in f.data.items()]
    return [f.modality, f.identifier, f.mm_hash, pos.offset, pos.length, _digest(pos.is_embed),
            item]


def _install_recorder(worker: Any) -> None:
    runner = worker.worker.model_runner
    runner.seen_new = []
    update = runner._update_states

    def recording(so: Any) -> Any:
        for nr in so.scheduled_new_reqs:
            runner.seen_new.append({"req_id": nr.req_id, "embeds": _digest(nr.prompt_embeds),
                                    "features": [_feature(f) for f in nr.mm_features]})
        return update(so)

    runner._update_states = recording


def _seen(worker: Any) -> list[Any]:
    return list(worker.worker.model_runner.seen_new)


# ---------------------------------------------------------------- engine side


def _requests(round_: int) -> tuple[list[Any], Any]:
    import numpy as np
    import torch
    from vllm import SamplingParams

    rng = np.random.default_rng(0)
    clips = [rng.standard_normal(16000).astype(np.float32) * 0.1 for _ in range(2)]
    embeds = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(1))
    audio = [{"prompt": AUDIO_PROMPT, "multi_modal_data": {"audio": (c, 16000)}} for c in clips]
    prompts = [*audio, {"prompt_embeds": embeds.to(torch.bfloat16)}] if round_ == 0 \
        else [{"prompt": "fox " + AUDIO_PROMPT, "multi_modal_data": {"audio": (clips[0], 16000)}}]
    return prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=3)


def _outputs(outs: list[Any]) -> list[Any]:
    return [{"prompt": list(o.prompt_token_ids or []), "tokens": list(c.token_ids),
             "lp": [[[k, v.logprob] for k, v in sorted(step.items())] for step in c.logprobs]}
            for o in outs for c in o.outputs]


def _run(model: str, delta: bool) -> dict[str, Any]:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if delta:
        from engine_side.vllm import DeltaExecutor

        kw = {"distributed_executor_backend": DeltaExecutor,
              "additional_config": {"deltacast_mm_store_mb": STORE_MB}}
    llm = LLM(model=model, enforce_eager=True, block_size=32, max_model_len=256, seed=0,
              dtype="bfloat16", max_num_batched_tokens=256, enable_prompt_embeds=True,
              limit_mm_per_prompt={"audio": 1}, **kw)
    ex = cast(Any, llm.llm_engine.engine_core).engine_core.model_executor  # in-process client
    ex.collective_rpc(_install_recorder)
    out: dict[str, Any] = {"outputs": [_outputs(llm.generate(*_requests(r))) for r in (0, 1)]}
    out["seen"] = ex.collective_rpc(_seen)[0]
    if delta:
        stats = ex.encoder.items.stats
        out["store"] = {"written": stats.written, "hits": stats.hits, "inline": stats.inline,
                        "readers": len(ex.store.readers)}
        out["embeds_sent"] = _digest(_requests(0)[0][2]["prompt_embeds"])
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return out


def main(model_dir: str, path: str) -> None:
    model = str(build_tiny_audio_model(Path(model_dir)))
    result = {"default": _run(model, delta=False), "delta": _run(model, delta=True)}
    Path(path).write_text(json.dumps(result))


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in-process: reach the executor
    main(sys.argv[1], sys.argv[2])
