"""What a model family declares: the ``config.json`` architectures it reads, the fields of
``LlamaConfig`` that set it apart (read from ``config.json``), what of its files it cannot serve,
its tensor names where they differ from the model's, and its GGUF architecture names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from worker.model.config import LlamaConfig

Raw = dict[str, Any]  # a config.json


@dataclasses.dataclass(frozen=True)
class GGUFView:
    """What a family reads from a GGUF file's header: its architecture prefix (``qwen3``), the
    metadata, the tensor names, and ``floats`` (a small float tensor's values, by name)."""

    arch: str
    metadata: dict[str, Any]
    tensors: frozenset[str]
    floats: Callable[[str], list[float]]

    def get(self, key: str, default: Any = None) -> Any:
        """``<arch>.<key>`` from the metadata."""
        return self.metadata.get(f"{self.arch}.{key}", default)

# The fields every family sets; a family's ``fields`` overrides the ones it needs.
PLAIN: dict[str, Any] = dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding_window=None)


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the common part of ``config.json`` says, for the families' ``fields`` to build on."""

    architecture: str
    layers: int
    head_dim: int
    rope: dict[str, Any]  # ``rope_parameters``: the global layers' (``rope_parameters`` below)


def same_name(name: str) -> str | None:
    return name


def whole_config(raw: Raw) -> Raw:
    return raw


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.json's ``architectures`` entries
    fields: Callable[[Raw, Shape], dict[str, Any]]  # LlamaConfig fields beyond the common ones
    unsupported: Callable[[Raw, LlamaConfig], str | None] = lambda raw, cfg: None  # what it cannot serve
    # A file's tensor name under the model's names; None: a tensor of a part Sluice does not serve
    # (an image-and-text checkpoint's image tower), skipped at load.
    checkpoint_name: Callable[[str], str | None] = same_name
    # The config.json fields the text model reads: an image-and-text checkpoint nests them.
    text_config: Callable[[Raw], Raw] = whole_config
    gguf: dict[str, str] = dataclasses.field(default_factory=dict)  # GGUF architecture -> config.json's
    activation: str = "silu"  # hidden_act (or hidden_activation) the family's MLP computes
    # GGUF: the family's LlamaConfig fields from a file's header (over the ones every file gives),
    # its tensor names where llama.cpp's differ from the other families' (blk.N.<name> -> the
    # model's), tensors that are configuration rather than weights, and what llama.cpp's
    # converter added to the norm weights (to take it back off).
    gguf_fields: Callable[[GGUFView], dict[str, Any]] = lambda view: {}
    gguf_names: dict[str, str] = dataclasses.field(default_factory=dict)
    gguf_config_tensors: tuple[str, ...] = ()
    gguf_norm_offset: float = 0.0


def rope_parameters(raw: Raw, layer_type: str = "full_attention") -> dict[str, Any]:
    """transformers >= 5 writes one ``rope_parameters`` dict (Gemma 3: one per layer type); older
    files write ``rope_theta`` and ``rope_scaling`` (whose type key was once ``type``). Merge both
    spellings into one dict."""
    params = dict(raw.get("rope_parameters") or {})
    if isinstance(params.get(layer_type), dict):  # per layer type
        return rope_parameters({"rope_parameters": params[layer_type]})
    if isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    params.update(raw.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    if "rope_theta" in raw:
        params["rope_theta"] = raw["rope_theta"]
    return params


def window(raw: Raw) -> int | None:
    """``sliding_window`` as Mistral reads it: in every layer when set."""
    value = raw.get("sliding_window")
    return int(value) if value else None
