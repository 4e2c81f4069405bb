"""Small random Hugging Face checkpoints that tests build and save themselves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Sluice streams tokens from a scheduler and workers over ZeroMQ.",
    "Ünïcödé, emoji 🦊 and 日本語 are text too.",
    "Once upon a time there was a small language model that liked to count: one two three four.",
] * 10


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer of exactly ``vocab_size`` entries (<unk>=0, <s>=1, </s>=2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    # Pad with placeholder tokens so every id the model can sample decodes to something.
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_tokens([f"<extra_{i}>" for i in range(missing)])
    return tok


def save_llama_checkpoint(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random ``LlamaForCausalLM`` (GQA, non-default rope_theta) plus its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        # Wider than the default 0.02, so greedy argmax margins dwarf float32 rounding noise.
        initializer_range=0.1,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(settings["vocab_size"]).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
    return path


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Token ids ``transformers`` generates greedily for each prompt alone, never stopping at EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs
