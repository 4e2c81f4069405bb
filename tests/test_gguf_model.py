"""A GGUF file unlike SmolLM2's — untied output, sentencepiece vocabulary, several tensor types per
layer, q/k permuted as llama.cpp's converter permutes them — loads to exactly the parameters
``transformers`` loads from it, and the worker announces its BOS/EOS as transformers uses them."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import write_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants
from test_gguf import _sentencepiece_file

from protocol.config import WorkerConfig
from worker.engine import Worker
from worker.gguf.checkpoint import GGUFCheckpoint
from worker.gguf.file import GGUFFile
from worker.kernels import cpu as cpu_kernels
from worker.model.layers import Linear
from worker.model.llama import LlamaForCausalLM, _unfused
from worker.model.loader import load_model
from worker.model.quantized import QuantizedWeight, read_now
from worker.model.sharding import ShardLayout, take_quantized

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 128, 4, 4, 2
HEAD_DIM = HIDDEN // HEADS
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16, Q.F32]


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _write_model(path: Path, tokenizer: dict[str, list]) -> Path:
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokenizer["tokenizer.ggml.tokens"])
    writer.add_token_scores(tokenizer["tokenizer.ggml.scores"])
    writer.add_token_types(tokenizer["tokenizer.ggml.token_type"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    kinds = iter(TYPES * 8)

    def add(name: str, rows: int, cols: int, qtype: Q | None = None, permute_heads: int = 0) -> None:
        w = (rng.normal(size=(rows, cols)) * 0.1).astype(np.float32)
        if permute_heads:
            w = _llama_cpp_permute(w, permute_heads)
        qtype = qtype or next(kinds)
        if qtype == Q.F32:
            writer.add_tensor(name, w)
        elif qtype == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, quants.quantize(w, qtype), raw_dtype=qtype)

    add("token_embd.weight", vocab, HIDDEN, Q.Q8_0)
    add("output.weight", vocab, HIDDEN, Q.Q4_1)
    writer.add_tensor("output_norm.weight", (1 + rng.normal(size=HIDDEN) * 0.1).astype(np.float32))
    for i in range(LAYERS):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + rng.normal(size=HIDDEN) * 0.1).astype(np.float32))
        add(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, permute_heads=HEADS)
        add(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN, permute_heads=KV_HEADS)
        add(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        add(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        add(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        add(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    write_gguf(writer)
    return path


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("gguf-model")
    tokenizer = GGUFFile(_sentencepiece_file(d / "tokenizer-only.gguf")).metadata
    return _write_model(d / "model.gguf", tokenizer)


def test_parameters_equal_transformers_loading_the_same_file(model_file: Path) -> None:
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                                  dtype=torch.float32).state_dict()
    worker = Worker(WorkerConfig(model=str(model_file), num_kv_blocks=8, dtype="float32"))
    ours = worker.runner.model.checkpoint_state()
    assert set(ours) == set(theirs)
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    assert ours["lm_head.weight"].data_ptr() != ours["model.embed_tokens.weight"].data_ptr()  # untied
    info = worker.info
    assert (info.bos_token_id, info.eos_token_ids, info.add_bos_token) == (1, [2], True)
    assert info.chat_template is None and info.vocab_size == len(GGUFFile(model_file).metadata["tokenizer.ggml.tokens"])


@pytest.mark.skipif(not cpu_kernels.has_quantized_linear(cpu_kernels.load()), reason="no quantized kernel here (AVX-512 VNNI or AVX2)")
def test_quantized_linears_stay_quantized_with_the_files_exact_weights(model_file: Path) -> None:
    """``--dtype auto``: a linear whose parts are all block types the kernel reads is kept
    quantized (q/k rows un-permuted, q, k and v stacked as the float path stacks them), and reads
    back exactly as transformers dequantizes the file; one with a float part is dequantized."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(str(model_file.parent), gguf_file=model_file.name,
                                                  dtype=torch.float32).state_dict()
    worker = Worker(WorkerConfig(model=str(model_file), num_kv_blocks=8, dtype="auto"))
    model = worker.runner.model
    kept = {name for name, m in model.named_modules() if isinstance(m, Linear) and m.quant_format is not None}
    dense = {name for name, m in model.named_modules() if isinstance(m, Linear) and m.quant_format is None}
    assert "lm_head" in kept and kept and dense  # the file mixes both kinds
    assert worker.info.quantization and set(worker.info.quantization.split(", ")) <= {t.name for t in TYPES[:5]}
    ours = model.checkpoint_state()
    for name in kept:
        parts = _unfused(f"{name}.weight", model.config) or [(f"{name}.weight", 0)]
        for part, _ in parts:
            assert torch.equal(ours[part], theirs[part]), part


def test_a_quantized_load_holds_one_weights_codes_at_a_time(model_file: Path) -> None:
    """Each kept weight is read when the model takes it and packed at once: when a weight reaches
    the packer, no other weight's unpacked codes are alive (before, the reader built every
    weight's codes, a byte a weight, before the first was packed: 19 alive here)."""
    import gc

    checkpoint = GGUFCheckpoint(model_file)
    cfg = checkpoint.config
    alive: list[int] = []

    def pack(layer: Linear) -> None:
        gc.collect()
        alive.append(sum(type(o) is QuantizedWeight for o in gc.get_objects()))
        layer.quantized = None

    load_model(model_file, cfg, torch.float32, torch.device("cpu"), 64,
               weights=functools.partial(checkpoint.weights, keep_quantized=True), pack=pack)
    assert len(alive) >= 3 and max(alive) == 1, alive


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("keep_quantized", [False, True])
def test_a_tensor_parallel_rank_reads_exactly_its_slice_of_each_tensor(model_file: Path, rank: int,
                                                                         keep_quantized: bool) -> None:
    """Each rank reads only its rows or block-aligned columns of the file (``_part``), un-permutes
    its q/k heads alone and pads its vocabulary shard: the same values as slicing the whole
    tensor after reading it."""
    checkpoint = GGUFCheckpoint(model_file)
    cfg = checkpoint.config
    with torch.device("meta"):
        expected = LlamaForCausalLM(cfg, 1).checkpoint_shapes()
    read = checkpoint.weights(expected, torch.float32, torch.device("cpu"), None, keep_quantized)
    whole = {name: read_now(value) for name, value in read.items()}
    layout = ShardLayout(cfg, rank, 2)
    read = checkpoint.weights(expected, torch.float32, torch.device("cpu"), layout, keep_quantized)
    part = {name: read_now(value) for name, value in read.items()}
    assert set(part) == set(whole)
    for name, value in whole.items():
        sl = layout.slice_for(name, tuple(expected[name]))
        mine = part[name]
        if isinstance(value, QuantizedWeight):
            assert isinstance(mine, QuantizedWeight), name
            want = take_quantized(value, sl) if sl is not None else value
            for field in ("codes", "scales", "mins", "super_scales", "super_mins"):
                a, b = getattr(mine, field), getattr(want, field)
                assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b)), (name, field)
        else:
            assert isinstance(mine, torch.Tensor)
            assert torch.equal(mine, sl.take(value) if sl is not None else value), name
    embed = part["model.embed_tokens.weight"]
    rows = embed.codes.shape[0] if isinstance(embed, QuantizedWeight) else embed.shape[0]
    assert rows == -(-cfg.vocab_size // 2)  # padded to the shard
