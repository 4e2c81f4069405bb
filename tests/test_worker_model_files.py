"""Model directories: the built-in tiny model, what ModelInfo reads from a directory, clear
errors for directories that cannot load, and KV cache sizing."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from protocol.config import ConfigError, WorkerConfig
from worker.engine import Worker
from worker.kv_cache import KVCache, SwapSpace, bytes_per_block, num_blocks_for, parse_bytes
from worker.model.config import ModelLoadError
from worker.model.tiny import TINY_FILES, materialize_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return materialize_tiny(tmp_path_factory.mktemp("cache"))


def test_tiny_is_the_same_everywhere_and_written_once(tiny: Path, tmp_path: Path) -> None:
    again = materialize_tiny(tmp_path)
    for name in TINY_FILES:
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    stamp = (again / "model.safetensors").stat().st_mtime_ns
    assert materialize_tiny(tmp_path) == again and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-v1"]  # no temporary directory left behind


def test_tiny_is_a_small_llama_with_a_byte_level_tokenizer(tiny: Path) -> None:
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"] and cfg["max_position_embeddings"] == 8192
    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"] == 512
    assert [tok.token_to_id(t) for t in ("<unk>", "<s>", "</s>")] == [0, 1, 2]
    for text in ("Héllo, 日本語 🦊!", "The quick brown fox", " leading spaces\tand tabs\n"):
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    w = Worker(WorkerConfig(model=str(tiny), num_kv_blocks=16, dtype="float32"))
    assert 2_000_000 < w.num_params < 10_000_000  # counted before packing released the plain weights
    info = w.info
    assert (info.bos_token_id, info.eos_token_ids, info.add_bos_token) == (1, [2], True)
    assert info.vocab_size == 512 and info.max_model_len == 8192 and info.chat_template
    assert (info.num_kv_blocks, info.block_size) == (16, 16) and info.name == tiny.name  # served by its short name


def _model_dir(tiny: Path, tmp_path: Path) -> Path:
    d = tmp_path / "model"
    shutil.copytree(tiny, d)
    return d


def _edit_json(path: Path, **changes: object) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps({k: v for k, v in raw.items() if v is not ...}))


def _arch(d: Path) -> None:
    _edit_json(d / "config.json", architectures=["GPT2LMHeadModel"])


def _no_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()


def _shape(d: Path) -> None:
    _edit_json(d / "config.json", intermediate_size=512)


def _rope(d: Path) -> None:
    _edit_json(d / "config.json", rope_scaling={"rope_type": "mrope", "mrope_section": [16, 24, 24]})


def _act(d: Path) -> None:
    _edit_json(d / "config.json", hidden_act="gelu")


def _no_config(d: Path) -> None:
    (d / "config.json").unlink()


def _no_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()


def _missing_shard(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    names = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
             "lm_head.weight": "model-00002-of-00002.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))


def _too_long(d: Path) -> None:
    _edit_json(d / "config.json", max_position_embeddings=64)


@pytest.mark.parametrize(("damage", "message"), [
    (_arch, r"config\.json: unsupported architecture \['GPT2LMHeadModel'\]"),
    (_no_weights, r"model: no \*\.safetensors weights found"),
    (_shape, r"model\.safetensors: tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"),
    (_rope, r"config\.json: rope scaling type 'mrope' is not supported"),
    (_act, r"config\.json: hidden_act 'gelu' is not supported"),
    (_no_config, r"config\.json: missing"),
    (_no_tokenizer, r"tokenizer\.json: missing"),
    (_missing_shard, r"model-00002-of-00002\.safetensors: listed in model\.safetensors\.index\.json but missing"),
    (_too_long, r"config\.json: --max-model-len 128 exceeds the model's max_position_embeddings 64"),
])
def test_a_model_that_cannot_load_fails_with_one_clear_line(tiny: Path, tmp_path: Path,
                                                            damage: Callable[[Path], None], message: str) -> None:
    d = _model_dir(tiny, tmp_path)
    damage(d)
    with pytest.raises(ModelLoadError, match=message) as err:
        Worker(WorkerConfig(model=str(d), num_kv_blocks=4, max_model_len=128, dtype="float32"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("tokenizer_config", "bos", "add_bos"), [
    ({"bos_token": "<s>", "add_bos_token": False}, 1, False),  # explicit wins
    ({"bos_token": None}, None, False),  # Qwen2 style: no BOS at all
    ({"bos_token": "<s>", "tokenizer_class": "GPT2Tokenizer"}, 1, False),  # byte-level: adds nothing
    ({"bos_token": "<s>", "tokenizer_class": "LlamaTokenizerFast"}, 1, True),  # sentencepiece Llama: adds BOS
    ({}, 1, False),  # only config.json's bos_token_id, and a tokenizer that adds nothing
])
def test_bos_follows_what_transformers_would_do(tiny: Path, tmp_path: Path, tokenizer_config: dict[str, object],
                                                bos: int | None, add_bos: bool) -> None:
    d = _model_dir(tiny, tmp_path)
    (d / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    info = Worker(WorkerConfig(model=str(d), num_kv_blocks=4, dtype="float32")).info
    assert (info.bos_token_id, info.add_bos_token, info.chat_template) == (bos, add_bos, None)


def test_eos_ids_come_from_generation_config_then_config(tiny: Path, tmp_path: Path) -> None:
    d = _model_dir(tiny, tmp_path)
    _edit_json(d / "generation_config.json", eos_token_id=[2, 5])
    assert Worker(WorkerConfig(model=str(d), num_kv_blocks=4, dtype="float32")).info.eos_token_ids == [2, 5]
    (d / "generation_config.json").unlink()
    _edit_json(d / "config.json", eos_token_id=7)
    assert Worker(WorkerConfig(model=str(d), num_kv_blocks=4, dtype="float32")).info.eos_token_ids == [7]


def test_kv_cache_size_from_flags() -> None:
    assert parse_bytes("512MiB") == 512 << 20 and parse_bytes("2GiB") == 2 << 30 and parse_bytes("1000") == 1000
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        parse_bytes("lots")
    per_block = bytes_per_block(4, 16, 2, 32, torch.float32)
    assert per_block == 2 * 4 * 16 * 2 * 32 * 4
    assert num_blocks_for(WorkerConfig(num_kv_blocks=7, kv_cache_memory="1MiB"), per_block) == 7
    assert num_blocks_for(WorkerConfig(kv_cache_memory="1MiB"), per_block) == (1 << 20) // per_block
    # auto on the CPU: one longest sequence or min(max_num_seqs, 64) streams of 512 tokens, at most a
    # quarter of RAM
    per_token = per_block // 16
    assert num_blocks_for(WorkerConfig(), per_block, max_model_len=100) == 64 * 512 * per_token // per_block
    assert num_blocks_for(WorkerConfig(max_num_seqs=4), per_block, max_model_len=100) == 4 * 512 // 16
    assert num_blocks_for(WorkerConfig(max_num_seqs=4), per_block, max_model_len=40_000) == 40_000 // 16
    quarter = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4
    assert num_blocks_for(WorkerConfig(), per_block, max_model_len=quarter) == quarter // per_block
    with pytest.raises(ConfigError, match="hold no KV block"):
        num_blocks_for(WorkerConfig(kv_cache_memory="1KiB"), per_block)


def test_swap_space_grows_on_demand_and_keeps_what_it_holds() -> None:
    cache = KVCache(2, 32, 4, 2, 8, torch.float32, torch.device("cpu"))
    for i, layer in enumerate(cache.layers):
        layer.copy_(torch.arange(layer.numel(), dtype=torch.float32).view_as(layer) + 1000 * i)
    want = [layer.clone() for layer in cache.layers]
    swap = SwapSpace(cache)
    swap.swap_out([(3, 0)])
    swap.swap_out([(7, 20), (9, 5)])  # grows past its first allocation
    assert swap.host is not None and swap.host.num_blocks == 21
    for layer in cache.layers:
        layer.zero_()
    swap.swap_in([(0, 11), (20, 12), (5, 13)])
    for got, before in zip(cache.layers, want, strict=True):
        assert torch.equal(got[11], before[3]) and torch.equal(got[12], before[7]) and torch.equal(got[13], before[9])


def test_dtype_auto_follows_the_hardware_never_a_timing() -> None:
    from worker import cpu_isa
    from worker.model import cpu_matmul
    from worker.model.config import LlamaConfig
    from worker.model.loader import resolve_dtype

    cfg = LlamaConfig.from_file(materialize_tiny() / "config.json")
    assert cpu_matmul.choose_dtype(bf16_instructions=False).dtype == torch.float32
    with_instructions = cpu_matmul.choose_dtype(bf16_instructions=True)
    assert with_instructions.dtype == (torch.bfloat16 if cpu_matmul.can_pack() else torch.float32)
    # The same answer every time, busy machine or not: nothing is timed.
    here = {resolve_dtype("auto", torch.device("cpu"), cfg) for _ in range(3)}
    assert len(here) == 1
    want = torch.bfloat16 if cpu_isa.has_bf16_instructions() and cpu_matmul.can_pack() else torch.float32
    assert here.pop()[0] == want
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", torch.device("cuda"), cfg)[0] == torch.bfloat16
    assert resolve_dtype("float32", cpu, cfg)[0] == torch.float32
    assert resolve_dtype("bfloat16", cpu, cfg)[0] == torch.bfloat16


@pytest.mark.parametrize(("dtype", "own_kernel"),
                         [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)])
def test_packed_linear_matches_f_linear(dtype: torch.dtype, own_kernel: bool) -> None:
    """Every packed path (Sluice's kernel in float32 and bfloat16, oneDNN's blocked bfloat16
    weights) computes what F.linear computes, with and without a bias, at row counts that fill
    the kernel's 6-row tiles and leave every remainder, output sizes off its 64-output tiles, an
    odd input size (which the bfloat16 kernel leaves to oneDNN, or to F.linear where oneDNN has no
    bfloat16 path), and a strided input. The
    kernel's float32 rows do not depend on the batch: each row alone gives the same bits."""
    from worker.kernels import cpu as cpu_kernels
    from worker.model import cpu_matmul
    from worker.model.layers import Linear

    if own_kernel and not cpu_kernels.has_linear(cpu_kernels.load(), dtype):
        pytest.skip(f"the {dtype} kernel is not built on this CPU (no AVX2, or no compiler)")
    if not own_kernel and not cpu_matmul.onednn_bf16():
        pytest.skip("no oneDNN packed bfloat16 linear here (this torch build, or a CPU without AVX-512)")
    tol = {"rtol": 2e-2, "atol": 3e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    gen = torch.Generator().manual_seed(5)
    for in_features, out_features in ((96, 80), (95, 130), (64, 64)):
        for bias in (False, True):
            weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
            bias_t = torch.randn(out_features, generator=gen).to(dtype) if bias else None
            layer = Linear(in_features, out_features, bias=bias)
            layer.weight.data = weight
            if bias_t is not None:
                assert layer.bias is not None
                layer.bias.data = bias_t
            cpu_matmul.pack_layer(layer, own_kernel=own_kernel)
            kernel_runs = own_kernel and (in_features % 2 == 0 or dtype == torch.float32)
            # the plain copy is released where a packed path runs (else F.linear reads it)
            assert (layer.weight.numel() == 0) == (kernel_runs or cpu_matmul.onednn_bf16())
            assert (layer.kernels is not None) == kernel_runs
            if kernel_runs:
                assert torch.equal(layer.dense_weight(), weight)  # a checkpoint can still be read back
            for rows in (1, 2, 5, 6, 7, 13, 70):
                x = torch.randn(rows, 2 * in_features, generator=gen).to(dtype)[:, ::2]
                want = torch.nn.functional.linear(x.float(), weight.float(), None if bias_t is None else bias_t.float())
                plain = torch.nn.functional.linear(x, weight, bias_t)
                got = layer(x)
                assert got.shape == (rows, out_features) and got.dtype == dtype
                torch.testing.assert_close(got.float(), want, **tol)
                torch.testing.assert_close(got, plain, **tol)
                if kernel_runs:
                    assert all(torch.equal(layer(x[r : r + 1])[0], got[r]) for r in range(rows))


def test_cpu_cache_commits_memory_as_it_is_written() -> None:
    """The CPU cache reads as zeros everywhere but holds only the pages written so far."""
    def rss_mib() -> float:
        return int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024

    before = rss_mib()
    cache = KVCache(8, 4096, 16, 4, 64, torch.bfloat16, torch.device("cpu"))  # 512 MiB
    assert cache.nbytes == 512 << 20 and rss_mib() - before < 64
    assert all(not layer[-1].any() for layer in cache.layers)  # zeros, read without committing much
    cache.keys[3][:2048].fill_(1.0)  # half of one of the 16 tensors: 16 MiB
    grown = rss_mib() - before
    assert 12 < grown < 64, grown
    assert cache.keys[3].sum().item() == 2048 * 16 * 4 * 64 and not cache.values[3].any()
