"""A llama.cpp GGUF file as a Llama checkpoint: its config, its weights in the Hugging Face layout,
and its tokenizer, read with the ``gguf`` package (pure Python over a memory map).

Weights: GGUF names (``blk.3.attn_q.weight``) map to the model's (``model.layers.3.self_attn.
q_proj.weight``), quantized blocks are dequantized at load (``gguf_quants``), and the row
permutation llama.cpp's converter applies to the q and k projections is undone: within each
head it interleaves the two rotary halves (rows i and i + D/2 become neighbours), because its
rope rotates adjacent pairs while Hugging Face's rotates halves.

Tokenizer: a byte-level BPE (``tokenizer.ggml.model == "gpt2"``) built from the file's tokens
and merges, with its control tokens as special tokens, as ``transformers`` builds it from the
same file. Other tokenizer models are refused by name.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from worker.gguf_quants import UnsupportedTensorType, dequantize
from worker.model_config import LlamaConfig, ModelLoadError

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_end|>


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError / struct errors on foreign files
            raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None
        self.arch = str(self._field("general.architecture"))
        if self.arch != "llama":
            raise ModelLoadError(f"{path}: GGUF architecture {self.arch!r} is not supported (only llama)")
        self.tensors = {t.name: t for t in self.reader.tensors}

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise ModelLoadError(f"{self.path}: metadata {key} is missing")
            return default
        return field.contents()

    # ------------------------------------------------------------------ config

    @functools.cached_property
    def config(self) -> LlamaConfig:
        a = self.arch
        heads = int(self._field(f"{a}.attention.head_count"))
        hidden = int(self._field(f"{a}.embedding_length"))
        scaling = self.reader.fields.get(f"{a}.rope.scaling.type")
        if (scaling is not None and scaling.contents() not in ("none", "")) or "rope_freqs.weight" in self.tensors:
            raise ModelLoadError(f"{self.path}: rope scaling in GGUF files is not supported")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 0  # its item count, without decoding them
        eos = self.reader.fields.get("tokenizer.ggml.eos_token_id")
        bos = self.reader.fields.get("tokenizer.ggml.bos_token_id")
        return LlamaConfig(
            architecture="LlamaForCausalLM",
            vocab_size=int(self._field(f"{a}.vocab_size", vocab)),
            hidden_size=hidden,
            intermediate_size=int(self._field(f"{a}.feed_forward_length")),
            num_layers=int(self._field(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self._field(f"{a}.attention.head_count_kv", heads)),
            head_dim=int(self._field(f"{a}.rope.dimension_count", hidden // heads)),
            max_position_embeddings=int(self._field(f"{a}.context_length")),
            rope_theta=float(self._field(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=None,
            rms_norm_eps=float(self._field(f"{a}.attention.layer_norm_rms_epsilon")),
            tie_word_embeddings="output.weight" not in self.tensors,
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            sliding_window=None,
            bos_token_id=int(bos.contents()) if bos is not None else None,
            eos_token_ids=[int(eos.contents())] if eos is not None else [],
        )

    # ------------------------------------------------------------------ weights

    def hf_name(self, name: str) -> str:
        match = _BLOCK_NAME.match(name)
        if match:
            layer, part, kind = match.groups()
            if part in _LAYER_NAMES:
                return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
        else:
            base, _, kind = name.rpartition(".")
            if base in _GLOBAL_NAMES:
                return f"{_GLOBAL_NAMES[base]}.{kind}"
        raise ModelLoadError(f"{self.path}: unexpected tensor {name} for a llama model")

    def weights(self, expected: dict[str, torch.Size], dtype: torch.dtype,
                device: torch.device) -> dict[str, torch.Tensor]:
        """Every tensor under its model name, dequantized and cast to ``dtype`` on ``device``."""
        cfg = self.config
        state: dict[str, torch.Tensor] = {}
        for name, t in self.tensors.items():
            target = self.hf_name(name)
            shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists dimensions fastest first
            want = tuple(expected.get(target, ()))
            if target not in expected or shape != want:
                raise ModelLoadError(f"{self.path}: tensor {name} has shape {shape}, the metadata implies "
                                     f"{want or 'no such tensor'}")
            try:
                tensor = dequantize(np.asarray(t.data), t.tensor_type, shape)
            except UnsupportedTensorType as e:
                raise ModelLoadError(f"{self.path}: tensor {name}: {e}") from None
            if name.endswith("attn_q.weight"):
                tensor = _unpermute(tensor, cfg.num_heads)
            elif name.endswith("attn_k.weight"):
                tensor = _unpermute(tensor, cfg.num_kv_heads)
            state[target] = tensor.to(device=device, dtype=dtype)
        return state

    # ------------------------------------------------------------------ tokenizer

    def tokenizer(self) -> Tokenizer:
        kind = self._field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(f"{self.path}: GGUF tokenizer model {kind!r} is not supported (only gpt2 byte-level BPE)")
        tokens = [str(t) for t in self._field("tokenizer.ggml.tokens")]
        alphabet = set(_bytes_to_unicode().values())
        spell = _bytes_to_unicode()
        vocab = {(tok if set(tok) <= alphabet else "".join(spell[b] for b in tok.encode())): i
                 for i, tok in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in self._field("tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        types = self._field("tokenizer.ggml.token_type", [])
        special = [t for t, kind in zip(tokens, types, strict=False) if int(kind) == _CONTROL and set(t) <= alphabet]
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
        return tok

    def chat_template(self) -> str | None:
        template = self.reader.fields.get("tokenizer.chat_template")
        return str(template.contents()) if template is not None else None

    def add_bos_token(self) -> bool:
        return bool(self._field("tokenizer.ggml.add_bos_token", False))


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of the two rotary halves of q/k rows."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
