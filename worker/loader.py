"""From ``--model`` to a loaded model and the ``ModelInfo`` the frontend needs.

Weights are materialised straight from safetensors into the model built on the meta device, so
nothing is randomly initialised only to be overwritten.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from worker.llama import LlamaForCausalLM
from worker.model_config import LlamaConfig, ModelLoadError
from worker.tiny import materialize_tiny

log = logging.getLogger("sluice.worker")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_dir(model: str) -> Path:
    if model == "tiny":
        return materialize_tiny()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a directory (--model takes 'tiny' or a Hugging Face-format directory)")
    return path


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [f for f in files if not f.exists()]
        if missing:
            raise ModelLoadError(f"{missing[0]}: listed in {index.name} but missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights found")
    return files


def load_model(model_dir: Path, cfg: LlamaConfig, dtype: torch.dtype, device: torch.device,
               max_positions: int) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    expected = {name: p.shape for name, p in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name not in expected:
                    continue  # e.g. rotary inv_freq buffers some exporters save
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name]):
                    raise ModelLoadError(f"{file}: tensor {name} has shape {tuple(tensor.shape)}, "
                                         f"config.json implies {tuple(expected[name])}")
                state[name] = tensor.to(device=device, dtype=dtype)
    if cfg.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{model_dir}: weights missing from the safetensors files: {', '.join(missing[:3])}"
                             + (f" and {len(missing) - 3} more" if len(missing) > 3 else ""))
    model.load_state_dict(state, strict=False, assign=True)
    rotary = type(model.rotary)(cfg, max_positions)  # buffers are computed, not loaded
    model.rotary = rotary.to(device)
    return model.eval()


def read_tokenizer_files(model_dir: Path, cfg: LlamaConfig) -> dict[str, Any]:
    """tokenizer.json text, chat template, BOS/EOS ids, and whether prompts start with BOS."""
    tok_file = model_dir / "tokenizer.json"
    if not tok_file.exists():
        raise ModelLoadError(f"{tok_file}: missing (Sluice needs a `tokenizers` tokenizer.json)")
    tok_cfg: dict[str, Any] = {}
    if (model_dir / "tokenizer_config.json").exists():
        tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    eos_ids = list(cfg.eos_token_ids)
    gen_file = model_dir / "generation_config.json"
    if gen_file.exists():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
        if eos is not None:
            eos_ids = [eos] if isinstance(eos, int) else list(eos)
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # the list-of-named-templates form: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.exists():
        template = jinja_file.read_text()
    # Llama-style tokenizers prepend BOS unless told otherwise; the tokenizer.json post-processor
    # usually does it already, and the frontend never adds a second one.
    add_bos = bool(tok_cfg.get("add_bos_token", cfg.bos_token_id is not None))
    return {
        "tokenizer_json": tok_file.read_text(),
        "chat_template": template,
        "eos_token_ids": eos_ids,
        "bos_token_id": cfg.bos_token_id,
        "add_bos_token": add_bos,
    }


def resolve_dtype(name: str, device: torch.device, cfg: LlamaConfig) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda: no CUDA device is available")
    return torch.device(name)
