"""``sluice convert model.gguf out_dir/``: a GGUF file as a Hugging Face-format directory.

The directory holds what ``transformers`` (and ``sluice serve --model out_dir``) read: the weights
as ``model.safetensors`` (dequantized, Hugging Face names and q/k layout — exactly the tensors the
worker serves from the GGUF file), ``config.json``, ``generation_config.json``, ``tokenizer.json``
and ``tokenizer_config.json`` with the special tokens, ``add_bos_token`` and the chat template.
Quantization is not kept: the weights are written in ``--dtype`` (float32 by default, the values
the GGUF file's blocks stand for, exactly).

    python -m worker.gguf.convert model.gguf out_dir/ [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.gguf.checkpoint import GGUFCheckpoint
from worker.model.config import LlamaConfig, ModelLoadError
from worker.model.loader import DTYPES, load_model, resolve_model_dir
from worker.sampling_defaults import sampling_defaults


def hf_config(cfg: LlamaConfig, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` for ``cfg``: the fields ``transformers``' config of its family reads."""
    return {
        "architectures": [cfg.architecture],
        "model_type": cfg.architecture.removesuffix("ForCausalLM").lower(),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids or None,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def tokenizer_config(ckpt: GGUFCheckpoint) -> dict[str, Any]:
    """``tokenizer_config.json``: special tokens by text, whether prompts start with BOS, the
    chat template. The class is the generic fast tokenizer: tokenizer.json says everything."""
    tokens: list[str] = ckpt.metadata.get("tokenizer.ggml.tokens", [])
    out: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                           "model_max_length": ckpt.config.max_position_embeddings}
    for name, key in [("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")]:
        index = ckpt.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if index is not None and 0 <= int(index) < len(tokens):
            out[name] = tokens[int(index)]
    out["add_bos_token"] = ckpt.add_bos_token()
    out["add_eos_token"] = bool(ckpt.metadata.get("tokenizer.ggml.add_eos_token", False))
    template = ckpt.chat_template()
    if template is not None:
        out["chat_template"] = template
    return out


def convert(source: Path, out_dir: Path, dtype: torch.dtype = torch.float32,
            sampling: dict[str, float] | None = None) -> None:
    """Write ``source`` (a GGUF file) to ``out_dir`` (created; must not hold files already);
    ``sampling``: the model's sampling defaults, for its generation_config.json."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(f"{out_dir}: exists and is not an empty directory")
    ckpt = GGUFCheckpoint(source)
    cfg = ckpt.config
    if cfg.num_experts:
        raise ModelLoadError(f"{source}: mixture-of-experts files are not converted (yet); "
                             "sluice serve reads them as they are")
    if cfg.gemma or cfg.fused_checkpoint or cfg.rope_scaling is not None or cfg.rotary_dim:
        # hf_config writes the fields of Llama, Mistral, Qwen2 and Qwen3 only: a Gemma or Phi
        # config.json from it would describe another model
        raise ModelLoadError(f"{source}: {cfg.architecture} files are not converted (yet): only Llama and Qwen "
                             "files without rope scaling are; sluice serve reads it as it is")
    model = load_model(source, cfg, dtype, torch.device("cpu"), cfg.max_position_embeddings, weights=ckpt.weights)
    state = {name: t.contiguous() for name, t in model.checkpoint_state().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor with embed_tokens: transformers re-ties it on load
    tokenizer = ckpt.tokenizer()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out_dir / "config.json", hf_config(cfg, dtype))
    _write_json(out_dir / "generation_config.json",
                {"bos_token_id": cfg.bos_token_id, "eos_token_id": hf_config(cfg, dtype)["eos_token_id"]}
                | (sampling or {}))
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str())
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(ckpt))
    _as_umask_allows(out_dir)


def _as_umask_allows(out_dir: Path) -> None:
    """Every file readable as the umask allows, like any file written with open(): safetensors
    writes through a private temporary file (mode 0600), which would leave the weights readable
    by their owner alone, unlike the rest of the checkpoint."""
    mask = os.umask(0)
    os.umask(mask)
    for path in out_dir.iterdir():
        path.chmod(0o666 & ~mask)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sluice convert", description="write a GGUF model as a Hugging Face directory")
    p.add_argument("source", help="a .gguf file, or 'smollm2'")
    p.add_argument("out_dir", type=Path)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    try:
        source = resolve_model_dir(args.source)
        if not source.is_file():
            raise ModelLoadError(f"{source}: not a GGUF file")
        # The built-in SmolLM2's defaults come with it, so the directory serves as the file does.
        convert(source, args.out_dir, DTYPES[args.dtype], sampling_defaults(args.source, source, "auto")[0])
    except ModelLoadError as e:
        print(f"sluice convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out_dir} (serve it with: sluice serve --model {args.out_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
