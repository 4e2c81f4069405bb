"""GGUF files of the Qwen families (``qwen2``, ``qwen3``), laid out as llama.cpp's converter writes
them — q/k not permuted (llama.cpp rotates halves for Qwen), Qwen2's q/k/v biases, Qwen3's q/k
norms as ``attn_q_norm``/``attn_k_norm``, the head width as ``attention.key_length``, a byte-level
vocabulary with the ``qwen2`` split rule — generate what ``transformers`` generates from the
Hugging Face checkpoint they were written from, and ``sluice convert`` turns them back into a
checkpoint of the same family."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from checkpoints import hf_greedy, save_qwen2, save_qwen3, write_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from safetensors.torch import load_file
from worker_testing import Driver, greedy

from protocol.config import WorkerConfig
from protocol.messages import NewRequest
from worker.engine import Worker
from worker.gguf.convert import convert
from worker.gguf.file import GGUFFile
from worker.gguf.tokenizer import build_tokenizer

PROMPTS = {1: [5, 17, 42, 99, 3, 250, 7], 2: [300, 12, 12, 60, 201, 8, 33, 150, 4, 77, 91]}
NEW_TOKENS = 10
# Hugging Face name (after ``model.layers.N.``) -> GGUF name (after ``blk.N.``)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _gguf_name(hf: str) -> str:
    base, _, kind = hf.rpartition(".")
    if base.startswith("model.layers."):
        layer, _, part = base.removeprefix("model.layers.").partition(".")
        return f"blk.{layer}.{_LAYER[part]}.{kind}"
    return f"{_GLOBAL[base]}.{kind}"


def write_qwen_gguf(ckpt: Path, arch: str, path: Path, matrices: Q = Q.F32) -> Path:
    """``ckpt`` (a Hugging Face Qwen2 or Qwen3 directory) as llama.cpp's converter writes it; the
    2-D weights in ``matrices``' type."""
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
    writer.add_rope_freq_base(float((cfg.get("rope_parameters") or cfg)["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(vocab["</s>"])
    writer.add_add_bos_token(False)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("*.safetensors")):
        state |= load_file(shard)
    for name, tensor in state.items():
        w = tensor.float().numpy()
        if w.ndim == 2 and matrices != Q.F32:
            writer.add_tensor(_gguf_name(name), quants.quantize(w, matrices), raw_dtype=matrices)
        else:
            writer.add_tensor(_gguf_name(name), w)
    write_gguf(writer)
    return path


FAMILIES: dict[str, Callable[[Path], Path]] = {"qwen2": save_qwen2, "qwen3": save_qwen3}


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
