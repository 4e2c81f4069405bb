"""GGUF files of the Qwen families (``qwen2``, ``qwen3``), laid out as llama.cpp's converter writes
them — q/k not permuted (llama.cpp rotates halves for Qwen), Qwen2's q/k/v biases, Qwen3's q/k
norms as ``attn_q_norm``/``attn_k_norm``, the head width as ``attention.key_length``, a byte-level
vocabulary with the ``qwen2`` split rule — generate what ``transformers`` generates from the
Hugging Face checkpoint they were written from, and ``sluice convert`` turns them back into a
checkpoint of the same family."""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import (
    hf_greedy,
    save_gemma2,
    save_gemma3,
    save_llama_checkpoint,
    save_mixtral,
    save_olmoe,
    save_phi3,
    save_qwen2,
    save_qwen2_moe,
    save_qwen3,
    save_qwen3_moe,
    write_gguf,
)
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from safetensors.torch import load_file
from worker_testing import Driver, greedy

from protocol.config import WorkerConfig
from protocol.messages import NewRequest
from worker.engine import Worker
from worker.gguf.checkpoint import GGUFCheckpoint
from worker.gguf.convert import convert
from worker.gguf.file import GGUFFile
from worker.gguf.tokenizer import build_tokenizer
from worker.model.config import ModelLoadError

PROMPTS = {1: [5, 17, 42, 99, 3, 250, 7], 2: [300, 12, 12, 60, 201, 8, 33, 150, 4, 77, 91]}
NEW_TOKENS = 10
# Hugging Face name (after ``model.layers.N.``) -> GGUF name (after ``blk.N.``)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


# Where llama.cpp names a family's tensors its own way
_FAMILY_LAYER = {
    "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
    "gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"},
}
_FAMILY_LAYER["gemma2"] = _FAMILY_LAYER["gemma3"]


def _gguf_name(hf: str, arch: str = "") -> str:
    hf = hf.replace(".block_sparse_moe.gate.", ".mlp.gate.")
    base, _, kind = hf.rpartition(".")
    if base.startswith("model.layers."):
        layer, _, part = base.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{(_LAYER | _FAMILY_LAYER.get(arch, {}))[part]}.{kind}"
    return f"{_GLOBAL[base]}.{kind}"


def write_qwen_gguf(ckpt: Path, arch: str, path: Path, matrices: Q = Q.F32) -> Path:
    """``ckpt`` (a Hugging Face Qwen2, Qwen3, Qwen3-MoE or Mixtral directory) as llama.cpp's
    converter writes it: experts stacked per projection, a Mixtral as a ``llama`` file with its
    q/k rows permuted; the matrices in ``matrices``' type."""
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"] | {t["content"]: t["id"] for t in tok["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or cfg
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "phi3":  # LongRoPE's factors as tensors, the rotated width, the original context
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if rope.get("rope_type") == "llama3":  # as llama.cpp's converter keeps Llama 3's scaling
        writer.add_tensor("rope_freqs.weight", _llama3_freq_factors(float(rope["rope_theta"]), head_dim, rope))
    if arch in ("gemma2", "gemma3"):
        writer.add_sliding_window(cfg["sliding_window"])
    if cfg.get("clip_qkv"):
        writer.add_clamp_kqv(cfg["clip_qkv"])
    if cfg.get("attn_logit_softcapping"):
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab["</s>"])
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_add_bos_token(False)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        state |= load_file(shard)
    stacked: dict[str, dict[int, torch.Tensor]] = {}
    for name in list(state):
        match = _EXPERT.match(name)
        if match is not None:
            layer, expert, proj = match.groups()
            stacked.setdefault(f"blk.{layer}.ffn_{_EXPERT_PROJ[proj]}_exps.weight", {})[int(expert)] = state.pop(name)
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    if arch in ("gemma2", "gemma3"):  # llama.cpp's converter stores Gemma's norm weights as 1 + w
        state = {name: t + 1 if name.endswith("norm.weight") else t for name, t in state.items()}
    tensors = {_gguf_name(name, arch): t for name, t in state.items()}
    tensors |= {name: torch.stack([parts[e] for e in sorted(parts)]) for name, parts in stacked.items()}
    for name, tensor in state.items():
        proj = name.rsplit(".", 2)[-2]
        if arch == "llama" and proj in heads:  # llama.cpp's rope pairs neighbours: its converter interleaves
            tensors[_gguf_name(name, arch)] = _llama_cpp_permute(tensor, heads[proj])
    for name, tensor in tensors.items():
        w = tensor.float().numpy()
        if name.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp's shape for the one-output gate: a vector
            w = w.reshape(-1)
        if w.ndim >= 2 and matrices != Q.F32 and w.shape[-1] % 32 == 0:  # else float, as llama.cpp falls back
            writer.add_tensor(name, quants.quantize(w, matrices), raw_dtype=matrices)
        else:
            writer.add_tensor(name, w)
    write_gguf(writer)
    return path


def _llama3_freq_factors(base: float, head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs`` for Llama 3's scaling: per rotated pair,
    the divisor of its frequency (1 for short wavelengths, the factor for long ones, and between
    them the interpolation's inverse)."""
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    original = float(rope["original_max_position_embeddings"])
    out = []
    for freq in (1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to a ``llama`` file's q/k rows: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


FAMILIES: dict[str, Callable[[Path], Path]] = {"qwen2": save_qwen2, "qwen3": save_qwen3}
# GGUF architecture -> a checkpoint of its family with experts (Mixtral is a ``llama`` file)
MIXTURES: dict[str, Callable[[Path], Path]] = {"qwen3moe": save_qwen3_moe, "llama": save_mixtral,
                                               "qwen2moe": save_qwen2_moe, "olmoe": save_olmoe}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    d = tmp_path_factory.mktemp(f"gguf-{request.param}")
    ckpt = FAMILIES[request.param](d / "hf")
    return request.param, ckpt, write_qwen_gguf(ckpt, request.param, d / "model.gguf")


def _greedy(worker: Worker) -> dict[int, list[int]]:
    """Each prompt's greedy continuation from the worker, all prompts in one batch."""
    d = Driver(worker.runner)
    d.plan([(rid, len(p)) for rid, p in PROMPTS.items()],
           [NewRequest(rid, p, len(p), greedy(NEW_TOKENS)) for rid, p in PROMPTS.items()])
    while d.live():
        d.plan([(rid, 1) for rid in d.live()], steps=4)
    return d.outputs


def test_a_qwen_gguf_generates_what_transformers_generates_from_its_checkpoint(family: tuple[str, Path, Path]) -> None:
    arch, ckpt, gguf_file = family
    worker = Worker(WorkerConfig(model=str(gguf_file), num_kv_blocks=64, block_size=8, dtype="float32"))
    cfg = worker.runner.model.config
    assert cfg.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    assert (cfg.qkv_bias, cfg.qk_norm) == ((True, False) if arch == "qwen2" else (False, True))
    want = dict(zip(PROMPTS, hf_greedy(ckpt, list(PROMPTS.values()), NEW_TOKENS), strict=True))
    assert _greedy(worker) == want


def test_a_quantized_qwen3_gguf_keeps_its_norms_and_its_unpermuted_heads(tmp_path: Path) -> None:
    """Q8_0 matrices: the model's weights are the file's blocks dequantized, rows in the file's
    order (a permutation undone here, as for ``llama`` files, would scramble every head)."""
    ckpt = save_qwen3(tmp_path / "hf")
    path = write_qwen_gguf(ckpt, "qwen3", tmp_path / "q8.gguf", Q.Q8_0)
    worker = Worker(WorkerConfig(model=str(path), num_kv_blocks=64, block_size=8, dtype="float32"))
    loaded = worker.runner.model.checkpoint_state()
    original = load_file(ckpt / "model.safetensors")
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        w = original[name].float().numpy()
        want = torch.from_numpy(quants.dequantize(quants.quantize(w, Q.Q8_0), Q.Q8_0).reshape(w.shape))
        assert torch.equal(loaded[name].float(), want), name
    assert torch.equal(loaded["model.layers.1.self_attn.k_norm.weight"], original["model.layers.1.self_attn.k_norm.weight"])


def test_sluice_convert_writes_a_checkpoint_of_the_same_family(family: tuple[str, Path, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    arch, ckpt, gguf_file = family
    out = tmp_path / "converted"
    convert(gguf_file, out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    original = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, original(ids).logits, atol=1e-5)


def test_the_qwen2_split_keeps_every_digit_apart(family: tuple[str, Path, Path]) -> None:
    """Qwen's rule, not Llama 3's (digits in threes) nor GPT-2's (digit runs)."""
    _, _, gguf_file = family
    ours = build_tokenizer(GGUFFile(gguf_file).metadata)
    assert ours.pre_tokenizer is not None
    pieces = [p for p, _ in ours.pre_tokenizer.pre_tokenize_str("year 2024, 12 items")]
    assert pieces == ["year", "Ġ", "2", "0", "2", "4", ",", "Ġ", "1", "2", "Ġitems"]


@pytest.mark.parametrize("arch", list(MIXTURES))
def test_a_mixture_of_experts_gguf_generates_what_transformers_generates(arch: str, tmp_path: Path) -> None:
    """Experts stacked per projection in the file, split into the model's experts; the router;
    Qwen3-MoE's unnormalised weights are llama.cpp's renormalised ones, so that checkpoint is
    written with norm_topk_prob on here (as Qwen3-MoE's released models have it); Qwen2-MoE's
    shared expert, its gate a vector in the file, and its weights never renormalised; OLMoE's
    whole-vector q/k norms and its clamp."""
    ckpt = MIXTURES[arch](tmp_path / "hf")
    if arch == "qwen3moe":
        cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps(cfg | {"norm_topk_prob": True}))
    path = write_qwen_gguf(ckpt, arch, tmp_path / "model.gguf")
    worker = Worker(WorkerConfig(model=str(path), num_kv_blocks=64, block_size=8, dtype="float32"))
    cfg = worker.runner.model.config
    assert cfg.architecture == {"qwen3moe": "Qwen3MoeForCausalLM", "llama": "MixtralForCausalLM",
                                "qwen2moe": "Qwen2MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[arch]
    assert cfg.num_experts == (5 if arch == "llama" else 6)
    assert cfg.normalize_expert_weights == (arch in ("qwen3moe", "llama"))
    assert cfg.dense_layers == ((1,) if arch in ("qwen3moe", "qwen2moe") else ())
    assert (cfg.qk_norm_whole, cfg.clip_qkv) == ((True, 1.5) if arch == "olmoe" else (False, 0.0))
    assert cfg.shared_expert_intermediate_size == (40 if arch == "qwen2moe" else 0)
    want = dict(zip(PROMPTS, hf_greedy(ckpt, list(PROMPTS.values()), NEW_TOKENS), strict=True))
    assert _greedy(worker) == want


def test_quantized_experts_stay_quantized(tmp_path: Path) -> None:
    """Q8_0 experts, on a CPU whose quantized kernel reads them: each expert's gate and up keep
    the file's blocks (3-D tensors split by rows, no dequantized copy); the down projections'
    24 inputs are no whole block, so the file has them in float."""
    from worker.kernels import cpu as cpu_kernels
    from worker.model.llama import SparseMoE

    if not cpu_kernels.has_linear(cpu_kernels.load(), torch.float32):
        pytest.skip("no packed linear kernel on this CPU")
    ckpt = save_qwen3_moe(tmp_path / "hf")
    path = write_qwen_gguf(ckpt, "qwen3moe", tmp_path / "q8.gguf", Q.Q8_0)
    worker = Worker(WorkerConfig(model=str(path), num_kv_blocks=64, block_size=8))
    moe = worker.runner.model.model.decoder_layers()[0].mlp
    assert isinstance(moe, SparseMoE)
    assert all(m.gate_up_proj.quant_format is not None and m.down_proj.quant_format is None for m in moe.mlps())
    d = Driver(worker.runner)
    d.plan([(1, len(PROMPTS[1]))], [NewRequest(1, PROMPTS[1], len(PROMPTS[1]), greedy(4))])
    while d.live():
        d.plan([(1, 1)])
    assert len(d.outputs[1]) == 4


OTHERS: dict[str, Callable[[Path], Path]] = {
    "phi3": save_phi3, "phi4_mini": lambda p: save_phi3(p, 0.75), "gemma3": lambda p: save_gemma3(p, True),
    "gemma2": lambda p: save_gemma2(p, True)}


@pytest.mark.parametrize("model", list(OTHERS))
def test_phi_and_gemma_ggufs_generate_what_transformers_generates(model: str, tmp_path: Path) -> None:
    """Phi-3 (fused attn_qkv and ffn_up, LongRoPE's factors as tensors; Phi-4-mini rotating 12 of
    16 dimensions), Gemma 3 (its norms stored as 1 + w, its own norm names, the window and
    llama.cpp's every-sixth-layer global) and Gemma 2 (every other layer windowed, both soft-caps
    in the header) as llama.cpp writes them. The prompts reach past LongRoPE's original 32
    positions, and past Gemma's 6-token window."""
    arch = model if model.startswith("gemma") else "phi3"
    ckpt = OTHERS[model](tmp_path / "hf")
    path = write_qwen_gguf(ckpt, arch, tmp_path / "model.gguf")
    worker = Worker(WorkerConfig(model=str(path), num_kv_blocks=64, block_size=8, dtype="float32"))
    cfg = worker.runner.model.config
    if arch == "gemma3":
        assert cfg.gemma and cfg.layer_windows == (6, 6, 6, 6, 6, 0)
    elif arch == "gemma2":
        assert cfg.gemma and cfg.layer_windows == (6, 0, 6, 0, 6) and (cfg.attention_softcap, cfg.final_logit_softcapping) == (3, 5)
    else:
        assert cfg.fused_checkpoint and cfg.rope_scaling is not None and cfg.rotated_dims == (12 if "4" in model else 16)
    want = dict(zip(PROMPTS, hf_greedy(ckpt, list(PROMPTS.values()), NEW_TOKENS), strict=True))
    assert _greedy(worker) == want
    with pytest.raises(ModelLoadError, match="files are not converted"):  # its config.json would be another model's
        convert(path, tmp_path / "converted")


def test_a_llama3_gguf_turns_with_its_frequency_factors(tmp_path: Path) -> None:
    """Llama 3.1-3.3 files keep Llama 3's rope scaling as per-pair frequency divisors (the tensor
    ``rope_freqs``, not a weight): greedy ids equal ``transformers``' on the checkpoint, with a
    prompt well past the original 64 positions; ``sluice convert`` refuses what its config.json
    would lose."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ckpt = save_llama_checkpoint(tmp_path / "hf", seed=1, rope_scaling=scaling, max_position_embeddings=512)
    path = write_qwen_gguf(ckpt, "llama", tmp_path / "l3.gguf")
    worker = Worker(WorkerConfig(model=str(path), num_kv_blocks=64, block_size=8, dtype="float32"))
    assert worker.runner.model.config.rope_scaling["rope_type"] == "freq_factors"
    prompt = [1, *(t % 300 + 3 for t in range(137))]
    d = Driver(worker.runner)
    d.plan([(1, len(prompt))], [NewRequest(1, prompt, len(prompt), greedy(12))])
    while d.live():
        d.plan([(1, 1)])
    assert d.outputs[1] == hf_greedy(ckpt, [prompt], 12)[0]
    with pytest.raises(ModelLoadError, match="files are not converted"):
        convert(path, tmp_path / "converted")
    short = np.ones(3, dtype=np.float32)  # factors for fewer pairs than the rotation turns: refused by name
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys.modules[__name__], "_llama3_freq_factors", lambda *_: short)
        bad = write_qwen_gguf(ckpt, "llama", tmp_path / "bad.gguf")
    with pytest.raises(ModelLoadError, match="rope_freqs holds 3 factors, the rotation turns 8 pairs"):
        GGUFCheckpoint(bad).config  # noqa: B018 - reading it is the test
