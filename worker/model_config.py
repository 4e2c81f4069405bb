"""The typed subset of a Hugging Face ``config.json`` that a Llama-family model needs."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


class ModelLoadError(RuntimeError):
    """The model cannot be loaded; the message is one line naming the file and the reason."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: q/k/v projections have a bias
    bos_token_id: int | None
    eos_token_ids: list[int]
    torch_dtype: str | None

    @classmethod
    def from_file(cls, path: Path) -> LlamaConfig:
        try:
            raw: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: missing (a model directory needs config.json)") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{path}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            eos = raw.get("eos_token_id")
            # transformers >= 5 writes rope settings as one `rope_parameters` dict instead of
            # `rope_theta` + `rope_scaling`; read both spellings.
            rope = raw.get("rope_parameters") or {}
            scaling = raw.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
                rope_scaling=scaling,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", arch == "Qwen2ForCausalLM")),
                attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{path}: missing or invalid field {e}") from None
