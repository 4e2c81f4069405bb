"""Llama 1-3 (SmolLM2, TinyLlama, ...) and Mistral: the decoder as it is.

Llama: ``attention_bias`` puts a bias on all four attention projections, ``mlp_bias`` on the
MLP's; Llama 3's rope scaling (``layers.rope_inv_freq``). GGUF: ``llama`` (its q/k rows permuted
by llama.cpp's converter: ``gguf.checkpoint``). Mistral: a sliding window in every layer."""

from __future__ import annotations

from typing import Any

from worker.model.families.base import PLAIN, Family, Raw, Shape, window


def _llama(raw: Raw, shape: Shape) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return PLAIN | dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def _mistral(raw: Raw, shape: Shape) -> dict[str, Any]:
    return PLAIN | dict(sliding_window=window(raw))


FAMILIES = (
    Family("llama", ("LlamaForCausalLM",), _llama, gguf={"llama": "LlamaForCausalLM"}),
    Family("mistral", ("MistralForCausalLM",), _mistral),
)
