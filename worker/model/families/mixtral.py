"""Mixtral: Mistral's decoder with a mixture of experts in every layer (``llama.SparseMoE``): the
top ``num_experts_per_tok`` of ``num_local_experts``, their weights always renormalised over the
chosen ones. Its files name the experts' projections as its reference code did (w1 the gate, w3
the up, w2 the down, under ``block_sparse_moe``); the model's names are Qwen3-MoE's. GGUF: a
``llama`` file with ``expert_count`` (``gguf.checkpoint``)."""

from __future__ import annotations

import re
from typing import Any

from worker.model.families.base import PLAIN, Family, Raw, Shape, window

_NAME = re.compile(r"^(model\.layers\.\d+\.)block_sparse_moe\.(gate\.|experts\.\d+\.w([123])\.)(weight|bias)$")
_PROJ = {"1": "gate_proj.", "2": "down_proj.", "3": "up_proj."}


def checkpoint_name(name: str) -> str:
    """Mixtral's ``block_sparse_moe.experts.N.w1`` is the model's ``mlp.experts.N.gate_proj`` (w3:
    up, w2: down) and its router ``block_sparse_moe.gate`` the model's ``mlp.gate``."""
    match = _NAME.match(name)
    if match is None:
        return name
    layer, part, w, kind = match.groups()
    if w is not None:
        part = part[: -len(f"w{w}.")] + _PROJ[w]
    return f"{layer}mlp.{part}{kind}"


def _mixtral(raw: Raw, shape: Shape) -> dict[str, Any]:
    return PLAIN | dict(sliding_window=window(raw), num_experts=int(raw["num_local_experts"]),
                        experts_per_token=int(raw["num_experts_per_tok"]),
                        expert_intermediate_size=int(raw["intermediate_size"]), normalize_expert_weights=True)


FAMILIES = (Family("mixtral", ("MixtralForCausalLM",), _mixtral, checkpoint_name=checkpoint_name),)
