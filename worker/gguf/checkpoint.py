"""A llama.cpp GGUF file as a Llama-family checkpoint (architectures ``llama``, ``qwen2`` and
``qwen3``): its config, its weights in the Hugging Face layout, and its tokenizer, read by
``gguf.file`` from a memory map.

Weights: GGUF names (``blk.3.attn_q.weight``) map to the model's (``model.layers.3.self_attn.
q_proj.weight``), quantized blocks are dequantized at load (``gguf.quants``), and in ``llama``
files the row permutation llama.cpp's converter applies to the q and k projections is undone:
within each head it interleaves the two rotary halves (rows i and i + D/2 become neighbours),
because llama.cpp's ``llama`` rope rotates adjacent pairs while Hugging Face's rotates halves.
Qwen's files are not permuted: llama.cpp rotates halves for them too (its NeoX rope).

Tokenizer: ``gguf.tokenizer`` builds it from the metadata, as ``transformers`` does.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from tokenizers import Tokenizer

from worker.gguf.file import GGUFFile, GGUFFormatError, GGUFTensor
from worker.gguf.quants import KEPT_BITS, UnsupportedTensorType, block_codes, dequantize, reads_codes
from worker.gguf.tokenizer import UnsupportedTokenizer, build_tokenizer
from worker.model.config import LlamaConfig, ModelLoadError
from worker.model.families import GGUF_ARCHITECTURES, family_of
from worker.model.families.base import GGUFView
from worker.model.quantized import CheckpointValue, PendingQuantized, QuantizedWeight
from worker.model.sharding import ShardLayout, Slice, pad, take_quantized

log = logging.getLogger("sluice.worker")

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"  # a rotated pair's frequency divisors (Llama 3's scaling)
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# A mixture of experts' tensors: the router, and each projection of every expert stacked in one
# 3-D tensor [experts, rows, columns] (each expert's rows contiguous), split here into the experts.
_EXPERT_NAME = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.file = GGUFFile(path)
        except (GGUFFormatError, ValueError, OSError) as e:  # ValueError: numpy cannot map an empty file
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
        self.metadata = self.file.metadata
        self.tensors = self.file.tensors
        self.kept_bytes = 0  # the file's bytes of the tensors ``weights`` kept quantized
        self.arch = str(self._field("general.architecture"))
        if self.arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: GGUF architecture {self.arch!r} is not supported "
                                 f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
        self.permuted_qk = self.arch == "llama"  # see the module's docstring
        self.family = family_of(GGUF_ARCHITECTURES[self.arch])
        self.layer_names = _LAYER_NAMES | self.family.gguf_names

    def _field(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        if value is None:
            raise ModelLoadError(f"{self.path}: metadata {key} is missing")
        return value

    # ------------------------------------------------------------------ config

    @functools.cached_property
    def config(self) -> LlamaConfig:
        a = self.arch
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        scaling_type = self.metadata.get(f"{a}.rope.scaling.type", "none") or "none"
        if scaling_type not in ("none", "linear"):
            raise ModelLoadError(f"{self.path}: rope scaling {scaling_type!r} in GGUF files is not supported "
                                 "(none, linear, or frequency factors as the tensor rope_freqs)")
        scaling: dict[str, Any] | None = None
        if scaling_type == "linear":
            scaling = {"rope_type": "linear", "factor": float(self._field(f"{a}.rope.scaling.factor"))}
        if ROPE_FREQS in self.tensors:
            # Llama 3's scaling (3.1, 3.2, 3.3), as llama.cpp's converter writes it: each rotated
            # pair's frequency divided by its factor, the factors computed from the config's
            # rope_scaling (which the file does not keep)
            if scaling is not None:
                raise ModelLoadError(f"{self.path}: both linear rope scaling and frequency factors (rope_freqs)")
            scaling = {"rope_type": "freq_factors", "factors": self._floats(ROPE_FREQS)}
        experts = int(self.metadata.get(f"{a}.expert_count", 0))
        moe: dict[str, Any] = {}
        if experts:
            # Mixtral is a llama file with experts; llama.cpp renormalises the chosen experts'
            # weights for both (as Mixtral does, and Qwen3-MoE's released models do).
            moe = dict(num_experts=experts, experts_per_token=int(self._field(f"{a}.expert_used_count")),
                       expert_intermediate_size=int(self.metadata.get(f"{a}.expert_feed_forward_length")
                                                    or self._field(f"{a}.feed_forward_length")),
                       normalize_expert_weights=bool(self.metadata.get(f"{a}.expert_weights_norm", True)),
                       dense_layers=tuple(i for i in range(int(self._field(f"{a}.block_count")))
                                          if f"blk.{i}.ffn_gate_inp.weight" not in self.tensors))
        architecture = "MixtralForCausalLM" if experts and a == "llama" else GGUF_ARCHITECTURES[a]
        vocab = len(self.metadata.get("tokenizer.ggml.tokens", []))
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        # Qwen3's heads are not hidden / heads wide: llama.cpp writes their width as key_length.
        head_dim = self.metadata.get(f"{a}.attention.key_length") or self.metadata.get(f"{a}.rope.dimension_count")
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=int(self._field(f"{a}.vocab_size", vocab)),
            hidden_size=hidden,
            intermediate_size=int(self.metadata.get(f"{a}.feed_forward_length") or moe.get("expert_intermediate_size")
                                  or self._field(f"{a}.feed_forward_length")),
            num_layers=int(self._field(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(head_dim or hidden // heads),
            max_position_embeddings=int(self._field(f"{a}.context_length")),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias="blk.0.attn_q.bias" in self.tensors,
            o_bias="blk.0.attn_output.bias" in self.tensors,
            mlp_bias=False,
            qk_norm="blk.0.attn_q_norm.weight" in self.tensors,
            sliding_window=None,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=[int(eos)] if eos is not None else [],
            **moe,
        )
        view = GGUFView(a, self.metadata, frozenset(self.tensors), self._floats)
        cfg = LlamaConfig(**fields | self.family.gguf_fields(view))
        if scaling is not None and scaling["rope_type"] == "freq_factors" and \
                len(scaling["factors"]) != cfg.rotated_dims // 2:
            raise ModelLoadError(f"{self.path}: rope_freqs holds {len(scaling['factors'])} factors, the rotation "
                                 f"turns {cfg.rotated_dims // 2} pairs of dimensions")
        return cfg

    def _floats(self, name: str) -> list[float]:
        t = self.tensors[name]
        return [float(v) for v in dequantize(t.data, t.qtype, t.shape).reshape(-1)]

    # ------------------------------------------------------------------ weights

    def hf_name(self, name: str) -> str:
        match = _BLOCK_NAME.match(name)
        if match:
            layer, part, kind = match.groups()
            if part in self.layer_names:
                return f"model.layers.{layer}.{self.layer_names[part]}.{kind}"
        else:
            base, _, kind = name.rpartition(".")
            if base in _GLOBAL_NAMES:
                return f"{_GLOBAL_NAMES[base]}.{kind}"
        raise ModelLoadError(f"{self.path}: unexpected tensor {name} for a {self.arch} model")

    def _named_tensors(self) -> Iterator[tuple[str, str, GGUFTensor]]:
        """(GGUF name, model name, tensor) of every tensor, a mixture's stacked experts one by one."""
        for name, t in self.tensors.items():
            if name in self.family.gguf_config_tensors or name == ROPE_FREQS:
                continue  # read into the config (``config``), not a weight
            match = _EXPERT_NAME.match(name)
            if match is None:
                yield name, self.hf_name(name), t
                continue
            layer, proj = match.groups()
            experts, per_expert = t.shape[0], t.data.size // t.shape[0]
            for e in range(experts):
                yield name, f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight", \
                    GGUFTensor(f"{name}[{e}]", t.shape[1:], t.qtype, t.data[e * per_expert : (e + 1) * per_expert])

    def quantized_types(self) -> list[str]:
        """The quantized tensor types the file's matrices use, most weights first ([] for a float file)."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) >= 2 and t.qtype.name not in ("F32", "F16", "BF16"):  # 3-D: stacked experts
                counts[t.qtype.name] = counts.get(t.qtype.name, 0) + t.numel
        return sorted(counts, key=lambda name: -counts[name])

    def weights(self, expected: dict[str, torch.Size], dtype: torch.dtype, device: torch.device,
                layout: ShardLayout | None = None, keep_quantized: bool = False) -> dict[str, CheckpointValue]:
        """Every tensor under its model name, dequantized and cast to ``dtype`` on ``device``; with
        ``keep_quantized``, matrices in a type ``block_codes`` reads stay quantized instead
        (``PendingQuantized``, read when the model takes it: it keeps the linear ones quantized
        and dequantizes the rest); the
        matrices of any other type are dequantized, said once in the log per type. With a
        tensor-parallel ``layout``, this rank's part of each tensor, read from its own blocks
        (``_part``)."""
        cfg = self.config
        state: dict[str, CheckpointValue] = {}
        dequantized: dict[str, int] = {}
        for name, target, t in self._named_tensors():
            want = tuple(expected.get(target, ()))
            if len(want) == 2 and want[0] == 1 and tuple(t.shape) == want[1:]:  # a one-output gate kept as a vector
                t = GGUFTensor(t.name, want, t.qtype, t.data)
            if target not in expected or t.shape != want:
                raise ModelLoadError(f"{self.path}: tensor {name} has shape {t.shape}, the metadata implies "
                                     f"{want or 'no such tensor'}")
            sl = layout.slice_for(target, t.shape) if layout is not None else None
            part = _part(t, sl)
            data, shape = part if part is not None else (t.data, t.shape)
            after = sl if part is None else None  # a slice the blocks did not allow: taken once read
            # q and k rows are permuted within each head: whole heads, however many this rank reads.
            heads = None
            if self.permuted_qk:
                heads = cfg.num_heads if name.endswith("attn_q.weight") else \
                    cfg.num_kv_heads if name.endswith("attn_k.weight") else None
            if heads is not None:
                heads = shape[0] // (t.shape[0] // heads)
            if keep_quantized and reads_codes(t.qtype, shape):  # read when the model takes it
                state[target] = PendingQuantized(functools.partial(self._quantized, t, data, shape, heads, after, sl))
                continue
            if keep_quantized and len(t.shape) == 2 and t.qtype.name not in ("F32", "F16", "BF16"):
                dequantized[t.qtype.name] = dequantized.get(t.qtype.name, 0) + 1
            try:
                tensor = dequantize(data, t.qtype, shape)
            except UnsupportedTensorType as e:
                raise ModelLoadError(f"{self.path}: tensor {name}: {e}") from None
            if heads is not None:
                tensor = _unpermute(tensor, heads)
            if self.family.gguf_norm_offset and target.endswith("norm.weight"):
                tensor = tensor + self.family.gguf_norm_offset  # Gemma's: stored as 1 + w
            if after is not None:
                tensor = after.take(tensor)
            elif sl is not None:
                tensor = pad(tensor, sl.dim, sl.size)
            state[target] = tensor.to(device=device, dtype=dtype)
            self.file.release(t)  # a view of the map stays right: its pages fault back in from the file
        for qtype, count in dequantized.items():
            log.info("%d %s matrices are served dequantized to %s: the quantized kernel reads %s", count, qtype,
                     str(dtype).removeprefix("torch."), ", ".join(t.name for t in KEPT_BITS))
        return state

    def _quantized(self, t: GGUFTensor, data: np.ndarray, shape: tuple[int, ...], heads: int | None,
                   after: Slice | None, sl: Slice | None) -> QuantizedWeight:
        """``weights``' quantized tensor, read: its blocks' codes and factors, q/k rows un-permuted
        within each head, this rank's slice taken or padded."""
        codes = block_codes(data, t.qtype, shape)
        assert codes is not None
        if heads is not None:
            codes = codes.rows(_unpermute(torch.arange(shape[0]).unsqueeze(1), heads).squeeze(1))
        if after is not None:
            codes = take_quantized(codes, after)
        elif sl is not None and sl.dim == 0:
            codes = codes.pad_rows(sl.size)
        self.kept_bytes += data.nbytes
        self.file.release(t)
        return codes

    # ------------------------------------------------------------------ tokenizer

    def tokenizer(self) -> Tokenizer:
        try:
            return build_tokenizer(self.metadata)
        except UnsupportedTokenizer as e:
            raise ModelLoadError(f"{self.path}: {e}") from None
        except KeyError as e:
            raise ModelLoadError(f"{self.path}: metadata {e.args[0]} is missing") from None

    def chat_template(self, name: str | None = None) -> str | None:
        """The file's chat template, or its template of that name (``tool_use``) if it has one."""
        template = self.metadata.get("tokenizer.chat_template" + (f".{name}" if name else ""))
        return str(template) if template is not None else None

    def add_bos_token(self) -> bool:
        """The file's flag; without one, True for sentencepiece vocabularies (llama.cpp and
        transformers both start their prompts with BOS) and False for byte-level ones."""
        default = self.metadata.get("tokenizer.ggml.model") == "llama"
        return bool(self.metadata.get("tokenizer.ggml.add_bos_token", default))


def _part(t: GGUFTensor, sl: Slice | None) -> tuple[np.ndarray, tuple[int, ...]] | None:
    """The bytes and shape of a slice of a matrix, read from its own blocks alone: any rows, or
    input columns that start and end on the type's blocks. None where that cannot be done (a
    vector, or columns inside a block): the caller reads the whole tensor and slices it."""
    if sl is None:
        return t.data, t.shape
    if len(t.shape) != 2:
        return None
    block, type_size = GGML_QUANT_SIZES[t.qtype]
    rows, cols = t.shape
    raw = t.data.reshape(rows, cols // block * type_size)
    if sl.dim == 0:
        return raw[sl.start : sl.stop], (sl.stop - sl.start, cols)
    if sl.start % block or sl.stop % block:
        return None
    return np.ascontiguousarray(raw[:, sl.start // block * type_size : sl.stop // block * type_size]), \
        (rows, sl.stop - sl.start)


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the two rotary halves of q/k rows."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
