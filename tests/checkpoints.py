"""Small random Hugging Face checkpoints (and GGUF files) that tests build and save themselves."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gguf import GGUFWriter
from tokenizers import AddedToken

from worker.model.tiny import build_byte_level_tokenizer


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
    build_byte_level_tokenizer(settings["vocab_size"]).save(str(path / "tokenizer.json"))
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


def hf_prompt_logprobs(path: Path, prompt: list[int], k: int) -> tuple[list[float], list[list[float]]]:
    """``transformers``' logprob of each prompt token after the first, and the ``k`` largest there."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    return chosen.tolist(), logprobs.topk(k).values.tolist()


def _save_hf(path: Path, config: Any, model_cls: Any, tokenizer_config: dict[str, Any], seed: int = 3,
             prepare: Callable[[Any], None] | None = None, **save: Any) -> Path:
    """A random ``model_cls(config)`` (``prepare`` sets what its initialiser leaves uniform), its
    byte-level tokenizer and ``tokenizer_config``, saved under ``path``."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    if prepare is not None:
        with torch.no_grad():
            prepare(model)
    model.save_pretrained(path, **save)
    build_byte_level_tokenizer(config.vocab_size).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


def with_tags(path: Path, tags: tuple[str, str], template: str) -> Path:
    """The checkpoint at ``path`` with its vocabulary's last two ids made the added tokens ``tags``
    (not special: their text stays in the output) and ``template`` as its chat template."""
    config = json.loads((path / "config.json").read_text())
    tok = build_byte_level_tokenizer(config["vocab_size"] - 2)
    tok.add_tokens([AddedToken(tag, special=False) for tag in tags])
    tok.save(str(path / "tokenizer.json"))
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"chat_template": template}))
    return path


SMALL: dict[str, Any] = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                             bos_token_id=1, eos_token_id=2, initializer_range=0.1)


def save_qwen2(path: Path) -> Path:
    """A random Qwen2: q/k/v bias, tied embeddings, no BOS, sharded safetensors."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SMALL, rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
                         tie_word_embeddings=True)
    ckpt = _save_hf(path, config, Qwen2ForCausalLM, {"bos_token": None, "eos_token": "</s>"}, max_shard_size="60KB")
    assert (ckpt / "model.safetensors.index.json").exists()
    return ckpt


def save_qwen3(path: Path) -> Path:
    """A random Qwen3: q/k RMSNorm per head (random weights, so q's and k's cannot be swapped
    unseen), head_dim 16 with 6 query heads over a hidden size of 64 (q is wider than the
    hidden state), GQA groups of 3, a vocabulary of 331, tied embeddings, no BOS."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    small = SMALL | dict(vocab_size=331, num_attention_heads=6, num_key_value_heads=2)
    config = Qwen3Config(**small, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 30000.0},
                         tie_word_embeddings=True, attention_bias=False)
    return _save_hf(path, config, Qwen3ForCausalLM, {"bos_token": None, "eos_token": "</s>"}, seed=5,
                    prepare=_randomised_routers)


def save_mistral(path: Path) -> Path:
    """A random Mistral with a 16-token sliding window: most of every prompt's context lies outside it."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(**SMALL, sliding_window=16)
    return _save_hf(path, config, MistralForCausalLM, {"bos_token": "<s>", "eos_token": "</s>"})


def write_gguf(writer: GGUFWriter) -> None:
    """Write out everything added to ``writer`` (header, metadata, tensors) and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _randomised_routers(model: Any) -> None:
    """Routers initialised apart (Qwen3-MoE's start at zero: every expert tied, topk then picks by
    index) and q/k norms away from 1 (so q's and k's cannot be swapped unseen)."""
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.copy_(torch.randn_like(p) * 0.5)
        elif name.endswith(("q_norm.weight", "k_norm.weight")):
            p.copy_(1 + 0.3 * torch.randn_like(p))


def save_mixtral(path: Path) -> Path:
    """A random Mixtral: 5 experts, 2 per token, every layer; its files name experts w1/w2/w3."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**SMALL | dict(intermediate_size=48), num_local_experts=5, num_experts_per_tok=2,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save_hf(path, config, MixtralForCausalLM, {"bos_token": "<s>", "eos_token": "</s>"}, seed=7,
                    prepare=_randomised_routers)


def save_qwen3_moe(path: Path) -> Path:
    """A random Qwen3-MoE: 6 experts of 24 rows, 3 per token, weights not renormalised, its second
    layer dense (``mlp_only_layers``), q/k norms per head."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**SMALL | dict(num_attention_heads=6, num_key_value_heads=2), head_dim=16,
                            moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                            mlp_only_layers=[1], tie_word_embeddings=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save_hf(path, config, Qwen3MoeForCausalLM, {"bos_token": None, "eos_token": "</s>"}, seed=8,
                    prepare=_randomised_routers)


def save_qwen2_moe(path: Path) -> Path:
    """A random Qwen2-MoE: Qwen2's q/k/v biases, 6 experts of 24 rows, 2 per token, weights not
    renormalised, and a shared expert of 40 rows every token runs, gated by sigmoid of its
    one-output gate (random, as the routers are); its second layer dense (``mlp_only_layers``)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(**SMALL, moe_intermediate_size=24, shared_expert_intermediate_size=40, num_experts=6,
                            num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
                            tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

    def prepare(model: Any) -> None:
        _randomised_routers(model)
        for name, p in model.named_parameters():
            if name.endswith("shared_expert_gate.weight"):
                p.copy_(torch.randn_like(p))

    return _save_hf(path, config, Qwen2MoeForCausalLM, {"bos_token": None, "eos_token": "</s>"}, seed=10,
                    prepare=prepare)

def save_olmoe(path: Path, clip_qkv: float | None = 1.5) -> Path:
    """A random OLMoE: 6 experts of 24 rows, 2 per token in every layer, weights not renormalised,
    q/k norms over the whole query and key (random weights: a per-head norm would differ), GQA
    (a key norm narrower than the query's), and q, k, v clamped at ``clip_qkv`` (low enough to
    bite on this model)."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(**SMALL | dict(intermediate_size=24), num_experts=6, num_experts_per_tok=2,
                         norm_topk_prob=False, clip_qkv=clip_qkv, tie_word_embeddings=False, pad_token_id=0,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return _save_hf(path, config, OlmoeForCausalLM, {"bos_token": "<s>", "eos_token": "</s>"}, seed=14,
                    prepare=_randomised_routers)

def save_phi3(path: Path, partial_rotary_factor: float = 1.0) -> Path:
    """A random Phi-3: q/k/v and gate/up fused in the file, LongRoPE (short factors inside the
    original 32 positions, long ones after), untied; with ``partial_rotary_factor`` 0.75 and tied
    embeddings, a Phi-4-mini (the first 12 of each head's 16 dimensions rotated)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    half = 8 if partial_rotary_factor == 1.0 else 6  # factors: one per rotated pair of dimensions
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [1.5 + 0.5 * i for i in range(half)],
            "partial_rotary_factor": partial_rotary_factor}
    config = Phi3Config(**SMALL | dict(max_position_embeddings=128), rope_parameters=rope,
                        partial_rotary_factor=partial_rotary_factor, sliding_window=None,
                        tie_word_embeddings=partial_rotary_factor != 1.0, pad_token_id=0,
                        original_max_position_embeddings=32)  # where Phi-3's files keep it too
    return _save_hf(path, config, Phi3ForCausalLM, {"bos_token": "<s>", "eos_token": "</s>"}, seed=9)


def save_gemma3(path: Path, released_pattern: bool = False) -> Path:
    """A random Gemma 3 (text): a 6-token window in layers 0, 1, 3 and 4, layer 2 and 5 global
    (a 3:1 pattern, here, to have two of each), 1,000,000 / 10,000 rope bases, query scaling 24,
    q/k norms, tied embeddings, norm weights random around 0 (Gemma's norms multiply by 1 + w).
    ``released_pattern``: as the released models are (and llama.cpp assumes): five windowed
    layers to one global, queries scaled by the head width."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["sliding_attention"] * 5 + ["full_attention"] if released_pattern else \
        ["sliding_attention", "sliding_attention", "full_attention"] * 2
    config = Gemma3TextConfig(**SMALL | dict(num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2),
                              head_dim=16, sliding_window=6, layer_types=kinds,
                              query_pre_attn_scalar=16 if released_pattern else 24, pad_token_id=0)
    return _save_hf(path, config, Gemma3ForCausalLM, {"bos_token": "<s>", "eos_token": "</s>"}, seed=11,
                    prepare=_norms_around_zero)


def _norms_around_zero(model: Any) -> None:
    """Gemma's norms multiply by 1 + w: weights random around 0, not the initialiser's zeros."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(0.3 * torch.randn_like(p))


def save_gemma2(path: Path, released_scaling: bool = False) -> Path:
    """A random Gemma 2: heads 32 wide (not hidden / heads: 16), every other layer a 6-token window
    (layers 0, 2, 4), query scaling 24, attention scores soft-capped at 3 and final logits at 5
    (the released models cap at 50 and 30: here low enough to bite on a random model's scores),
    norm weights random around 0.
    ``released_scaling``: queries scaled by the head width, as the 2B and 9B models are (and as
    llama.cpp assumes)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    small = SMALL | dict(hidden_size=96, num_hidden_layers=5, num_attention_heads=6, num_key_value_heads=2)
    config = Gemma2Config(**small, head_dim=32, sliding_window=6, query_pre_attn_scalar=32 if released_scaling else 24,
                          attn_logit_softcapping=3.0, final_logit_softcapping=5.0, pad_token_id=0)
    return _save_hf(path, config, Gemma2ForCausalLM, {"bos_token": "<s>", "eos_token": "</s>"}, seed=13,
                    prepare=_norms_around_zero)


def save_gemma3_multimodal(path: Path) -> Path:
    """An image-and-text Gemma 3 (``Gemma3ForConditionalGeneration``, as the 4B-27B models are
    released): ``save_gemma3``'s text model and weights under ``language_model.``, beside a small
    random image tower, with a config.json whose ``text_config`` holds only what differs from
    ``Gemma3TextConfig``'s defaults (as the released files' do: the rest comes from the class), its
    token ids at the top level, and the chat template in ``chat_template.json``."""
    from transformers import (
        Gemma3Config,
        Gemma3ForCausalLM,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = json.loads((save_gemma3(path / "text") / "config.json").read_text())
    defaults = Gemma3TextConfig().to_dict()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=Gemma3TextConfig(**{k: v for k, v in text.items() if k in defaults}).to_dict(),
                          vision_config=vision.to_dict(), mm_tokens_per_image=4, image_token_index=317,
                          boi_token_index=318, eoi_token_index=319, eos_token_id=[2, 316])
    torch.manual_seed(12)
    model = Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the text model's weights: the same model as save_gemma3's
        model.model.language_model.load_state_dict(Gemma3ForCausalLM.from_pretrained(path / "text").model.state_dict())
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    saved["text_config"] = {k: v for k, v in saved["text_config"].items()
                            if k not in ("architectures", "dtype", "bos_token_id", "eos_token_id")
                            and (k not in defaults or v != defaults[k] or k == "model_type")}
    (path / "config.json").write_text(json.dumps(saved))
    build_byte_level_tokenizer(320).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (path / "chat_template.json").write_text(json.dumps({"chat_template": "{% for m in messages %}<{{ m['role'] }}>"
                                                         "{{ m['content'] }}{% endfor %}<assistant>"}))
    return path
