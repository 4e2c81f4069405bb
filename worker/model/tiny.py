"""The built-in ``tiny`` model: a small random Llama written as an ordinary Hugging Face directory.

It goes through exactly the loading path a real checkpoint does. Weights come from a fixed seed and
the tokenizer is a byte-level BPE trained on a built-in text, so every machine makes the same
model. The directory is written once (atomically: temp dir + rename) and reused.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_VERSION = "v1"
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Sluice streams tokens from a scheduler and workers over ZeroMQ sockets.",
    "Once upon a time there was a small language model that liked to count: one, two, three, four.",
    "Inference servers batch requests, page their key-value caches and stream every token.",
    "Ünïcödé text, emoji 🦊 and 日本語 are text too.",
] * 20


def build_byte_level_tokenizer(vocab_size: int, corpus: list[str] = CORPUS) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` ids: ``<unk>``=0, ``<s>``=1, ``</s>``=2, the 256
    byte symbols, merges learned from ``corpus``, and placeholder tokens to fill any rest."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    return tok


def _random_weights(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    h, inter, v = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["vocab_size"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = h // heads

    def normal(*shape: int, std: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {"model.embed_tokens.weight": normal(v, h, std=0.5), "model.norm.weight": torch.ones(h),
               "lm_head.weight": normal(v, h, std=0.1)}
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": normal(heads * head_dim, h),
            p + "self_attn.k_proj.weight": normal(kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": normal(kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": normal(h, heads * head_dim),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
        }
    return weights


def default_cache_dir() -> Path:
    root = os.environ.get("SLUICE_CACHE") or os.path.join(Path.home(), ".cache", "sluice")
    return Path(root)


TINY_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json", "model.safetensors")


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in TINY_FILES)


def materialize_tiny(cache_dir: Path | None = None) -> Path:
    """The tiny model's directory under ``cache_dir`` (default ``$SLUICE_CACHE`` or
    ``~/.cache/sluice``), written on first use.

    It is written into a temporary sibling and renamed into place, so a reader never sees a
    half-written model and concurrent first uses do not race: the loser of the rename finds the
    winner's identical copy and discards its own.
    """
    target = (cache_dir or default_cache_dir()) / f"tiny-{TINY_VERSION}"
    if _complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # damaged by hand (the rename never leaves a partial one): start over
        shutil.rmtree(target, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        _write(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not _complete(target):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(path: Path) -> None:
    (path / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }))
    build_byte_level_tokenizer(int(TINY_CONFIG["vocab_size"])).save(str(path / "tokenizer.json"))
    save_file(_random_weights(TINY_CONFIG), str(path / "model.safetensors"))
