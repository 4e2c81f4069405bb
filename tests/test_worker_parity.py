"""The worker's runner against ``transformers`` on the same checkpoints: greedy tokens alone,
batched, chunked (mixed with decodes), multi-step and after a recompute preemption; logits of a
chunk after a cached prefix; llama3 rope scaling; Qwen2 (q/k/v bias, tied embeddings) loaded
from shards; Mistral's sliding window."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from checkpoints import (
    hf_greedy,
    save_gemma2,
    save_gemma3,
    save_gemma3_multimodal,
    save_llama_checkpoint,
    save_mistral,
    save_mixtral,
    save_olmoe,
    save_phi3,
    save_qwen2,
    save_qwen2_moe,
    save_qwen3,
    save_qwen3_moe,
)
from worker_testing import Driver, greedy, one_cpu_thread

from protocol.config import WorkerConfig
from protocol.messages import NewRequest, SamplingParams, unpack_logprobs
from worker.attention import SdpaBackend
from worker.engine import Worker

NEW = 32
PROMPTS = {
    0: [1, *range(10, 14)],
    1: [1, *range(20, 36)],
    2: [1, *range(40, 79)],
    3: [1, *(t % 300 + 3 for t in range(69))],
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_cpu_thread():
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_checkpoint(tmp_path_factory.mktemp("w") / "llama")


@pytest.fixture(scope="module")
def expected(checkpoint: Path) -> dict[int, list[int]]:
    return dict(zip(PROMPTS, hf_greedy(checkpoint, list(PROMPTS.values()), NEW), strict=True))


@pytest.fixture(scope="module")
def worker(checkpoint: Path) -> Worker:
    return Worker(WorkerConfig(model=str(checkpoint), num_kv_blocks=512, block_size=8, dtype="float32"))


@pytest.mark.parametrize("steps", [1, 8])
def test_each_prompt_alone_matches_transformers(worker: Worker, expected: dict[int, list[int]], steps: int) -> None:
    for rid, prompt in PROMPTS.items():
        d = Driver(worker.runner)
        d.prefill({rid: prompt}, greedy(NEW), steps)
        d.decode_to_end(steps)
        assert d.outputs[rid] == expected[rid], f"prompt {rid}"


@pytest.mark.parametrize("steps", [1, 8])
def test_batched_prompts_match_transformers(worker: Worker, expected: dict[int, list[int]], steps: int) -> None:
    d = Driver(worker.runner)
    d.prefill(PROMPTS, greedy(NEW), steps)
    d.decode_to_end(steps)
    assert d.outputs == expected


@pytest.mark.parametrize("steps", [1, 3])
def test_chunked_prefills_mixed_with_decodes_match_transformers(worker: Worker, expected: dict[int, list[int]],
                                                                 steps: int) -> None:
    """Prompt k starts at plan k and advances 7 tokens per plan, in the same forward passes
    as the decodes of the prompts that started before it."""
    d = Driver(worker.runner)
    chunk, started = 7, 0
    while started < len(PROMPTS) or d.live():
        new, rows = [], []
        for rid in d.live():
            seq = worker.runner.seqs[rid]
            rows.append((rid, min(chunk, len(seq.token_ids) - seq.num_computed)))
        if started < len(PROMPTS):
            prompt = PROMPTS[started]
            new.append(NewRequest(started, prompt, len(prompt), greedy(NEW)))
            rows.append((started, min(chunk, len(prompt))))
            started += 1
        d.plan(rows, new, steps)
    assert d.outputs == expected


def test_recompute_after_preemption_matches_transformers(worker: Worker, expected: dict[int, list[int]]) -> None:
    d = Driver(worker.runner)
    rid, prompt = 2, PROMPTS[2]
    d.prefill({rid: prompt}, greedy(NEW))
    for _ in range(9):
        d.plan([(rid, 1)])
    known = prompt + d.outputs[rid]  # everything so far; the worker's state is then dropped
    d.plan([(rid, len(known))], [NewRequest(rid, known, len(prompt), greedy(NEW))], forget=[rid])
    d.decode_to_end(4)
    assert d.outputs[rid] == expected[rid]


def test_logits_match_transformers_forward(worker: Worker, checkpoint: Path) -> None:
    """One forward pass holding a whole prompt and, for another, the chunk after a 30-token
    prefix computed by an earlier plan: every position's logits match."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    whole, chunked = PROMPTS[2], PROMPTS[3]
    with torch.no_grad():
        want_whole = hf(torch.tensor([whole])).logits[0]
        want_chunk = hf(torch.tensor([chunked])).logits[0, 30:]
    runner = worker.runner
    d = Driver(runner)
    d.plan([(5, 30)], [NewRequest(5, chunked, len(chunked), greedy(1))])  # the prefix: samples nothing
    assert d.outputs == {} and runner.seqs[5].num_computed == 30
    chunk_table = d.tables[5] + [next(d.free) for _ in range(5)]
    whole_table = [next(d.free) for _ in range(5)]
    n = len(chunked) - 30
    # the runner's own backend: the prefix's keys lie in the cache as its kernels keep them
    meta = runner.attention.build(runner.cache, [whole_table, chunk_table], [0, 30], [len(whole), n],
                                  list(range(len(whole) + n)))
    with torch.inference_mode():
        got = runner.model(torch.tensor(whole + chunked[30:], device=runner.device), meta).cpu()
    torch.testing.assert_close(got[: len(whole)], want_whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[len(whole) :], want_chunk, atol=1e-4, rtol=1e-4)


def test_contexts_of_very_different_lengths_attend_in_groups_and_match_transformers(worker: Worker,
                                                                                      checkpoint: Path) -> None:
    """A 300-token prompt batched with short ones: attention splits the rows into groups (the
    long row is not padded onto the others), in the prefill and in every decode step."""
    long_prompt = [1, *((7 * t) % 300 + 3 for t in range(299))]
    prompts = {0: PROMPTS[0], 1: long_prompt, 2: PROMPTS[1], 3: PROMPTS[3]}
    want = dict(zip(prompts, hf_greedy(checkpoint, list(prompts.values()), 10), strict=True))
    runner = worker.runner
    meta = SdpaBackend(runner.device).build(runner.cache, [list(range(40)), [40, 41]], [len(long_prompt), 5], [1, 1],
                                            [0, 1])
    assert [g.block_table.shape[0] for g in meta.groups] == [1, 1]
    d = Driver(runner)
    d.prefill(prompts, greedy(10), steps=4)
    d.decode_to_end(3)
    assert d.outputs == want


def test_logprobs_equal_transformers_log_softmax(worker: Worker, checkpoint: Path) -> None:
    """Each step's sampled and top-5 logprobs, from a batch of two with multi-step decoding,
    equal ``log_softmax`` of transformers' logits at that position within 1e-4."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    d = Driver(worker.runner)
    d.plan([(1, len(PROMPTS[1])), (2, len(PROMPTS[2]))],
           [NewRequest(1, PROMPTS[1], len(PROMPTS[1]), greedy(8, logprobs=5)),
            NewRequest(2, PROMPTS[2], len(PROMPTS[2]),
                       SamplingParams(max_tokens=8, seed=7, ignore_eos=True, logprobs=5))], steps=4)
    d.decode_to_end(4)
    for rid in (1, 2):
        entries = [unpack_logprobs(m.logprobs)[rid][0] for m in d.messages if rid in m.rids]
        outputs = d.outputs[rid]
        assert len(entries) == len(outputs) == 8
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPTS[rid] + outputs[:-1]])).logits[0, len(PROMPTS[rid]) - 1 :]
        want = logits.log_softmax(-1)
        for i, (token, entry) in enumerate(zip(outputs, entries, strict=True)):
            assert entry is not None
            sampled, ids, values = entry
            top = want[i].topk(5)
            assert abs(sampled - float(want[i, token])) < 1e-4
            assert ids == top.indices.tolist()
            torch.testing.assert_close(torch.tensor(values), top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("saved", [torch.bfloat16, torch.float16])
def test_half_precision_checkpoints_cast_to_float32_match_transformers(tmp_path: Path, saved: torch.dtype) -> None:
    from safetensors.torch import load_file, save_file

    ckpt = save_llama_checkpoint(tmp_path / "half", seed=2)
    weights = ckpt / "model.safetensors"
    save_file({k: v.to(saved) for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"dtype": str(saved).removeprefix("torch.")}))
    want = hf_greedy(ckpt, [PROMPTS[2]], 12)  # transformers upcasts to float32 too
    w = Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8, dtype="float32"))
    assert {p.dtype for p in w.runner.model.parameters()} == {torch.float32}
    d = Driver(w.runner)
    d.prefill({0: PROMPTS[2]}, greedy(12), 4)
    d.decode_to_end(4)
    assert [d.outputs[0]] == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_flag_casts_weights_and_cache(checkpoint: Path, dtype: str) -> None:
    """A float32 checkpoint served in half precision: weights and KV cache in that dtype, and
    its logits close to transformers' float32 ones (half precision cannot promise the argmax)."""
    from transformers import AutoModelForCausalLM

    w = Worker(WorkerConfig(model=str(checkpoint), num_kv_blocks=16, block_size=8, dtype=dtype))
    want_dtype = getattr(torch, dtype)
    assert {p.dtype for p in w.runner.model.parameters()} == {want_dtype}
    assert {t.dtype for t in w.runner.cache.layers} == {want_dtype}
    prompt = PROMPTS[1]
    runner = w.runner
    meta = SdpaBackend(runner.device).build(runner.cache, [[0, 1, 2]], [0], [len(prompt)], list(range(len(prompt))))
    with torch.inference_mode():
        got = runner.model(torch.tensor(prompt, device=runner.device), meta).cpu()
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert got.dtype == torch.float32  # the sampler always sees float32 logits
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    ckpt = save_llama_checkpoint(tmp_path / "l3", seed=1, rope_scaling=scaling, max_position_embeddings=512)
    prompt = PROMPTS[3] * 2  # 138 tokens: well past the original 64 positions
    want = hf_greedy(ckpt, [prompt], 16)[0]
    d = Driver(Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8, dtype="float32")).runner)
    d.prefill({0: prompt}, greedy(16), 16)
    assert d.outputs[0] == want


FAMILIES = {"qwen2": save_qwen2, "qwen3": save_qwen3, "mistral": save_mistral, "mixtral": save_mixtral,
            "qwen3_moe": save_qwen3_moe, "qwen2_moe": save_qwen2_moe, "olmoe": save_olmoe, "phi3": save_phi3, "phi4_mini": lambda p: save_phi3(p, 0.75),
            "gemma2": save_gemma2, "gemma3": save_gemma3, "gemma3_multimodal": save_gemma3_multimodal}
FAMILY_NEW = 12


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Worker, dict[int, list[int]]]:
    ckpt = FAMILIES[request.param](tmp_path_factory.mktemp(request.param) / "ckpt")
    want = dict(zip(PROMPTS, hf_greedy(ckpt, list(PROMPTS.values()), FAMILY_NEW), strict=True))
    return Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=128, block_size=8, dtype="float32")), want


def test_family_loads_what_its_files_say(family: tuple[Worker, dict[int, list[int]]]) -> None:
    w, _ = family
    cfg = w.runner.model.config
    if cfg.architecture == "Qwen2ForCausalLM":
        assert cfg.qkv_bias and not cfg.qk_norm
        assert w.info.bos_token_id is None and not w.info.add_bos_token
    elif cfg.architecture == "Gemma3ForCausalLM":
        assert cfg.gemma and cfg.qk_norm and cfg.layer_windows == (6, 6, 0, 6, 6, 0) and cfg.local_rope_theta == 10000.0
        assert cfg.attention_scale == pytest.approx(24**-0.5) and w.runner.model.cpu_decoder is None
    elif cfg.architecture == "Gemma2ForCausalLM":
        assert cfg.gemma and not cfg.qk_norm and cfg.layer_windows == (6, 0, 6, 0, 6) and cfg.local_rope_theta == 10000.0
        assert (cfg.attention_softcap, cfg.final_logit_softcapping) == (3.0, 5.0) and w.runner.model.cpu_decoder is None
        assert w.runner.attention.softcap == 3.0 and w.runner.windowed[6].softcap == 3.0
    elif cfg.architecture == "Gemma3ForConditionalGeneration":  # the text model; text_config's gaps filled in
        assert cfg.gemma and cfg.qk_norm and cfg.layer_windows == (6, 6, 0, 6, 6, 0) and cfg.local_rope_theta == 10000.0
        assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.num_heads, cfg.vocab_size) == (1e6, 1e-6, 8, 320)
        assert cfg.tie_word_embeddings and w.info.eos_token_ids == [2, 316] and w.info.chat_template is not None
    elif cfg.architecture == "Phi3ForCausalLM":
        assert cfg.fused_checkpoint and cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
        assert cfg.rotated_dims == (16 if not cfg.tie_word_embeddings else 12)
    elif cfg.architecture == "MixtralForCausalLM":
        assert (cfg.num_experts, cfg.experts_per_token, cfg.dense_layers) == (5, 2, ())
        assert w.runner.model.cpu_decoder is None  # no expert stage in decoder.c: operator by operator
    elif cfg.architecture == "Qwen3MoeForCausalLM":
        assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (6, 3, 24)
        assert cfg.dense_layers == (1,) and not cfg.normalize_expert_weights and cfg.qk_norm
    elif cfg.architecture == "OlmoeForCausalLM":
        assert cfg.qk_norm_whole and cfg.clip_qkv == 1.5 and (cfg.num_experts, cfg.experts_per_token) == (6, 2)
        assert w.runner.model.model.decoder_layers()[0].self_attn.k_norm.weight.shape == (32,)  # the whole key
    elif cfg.architecture == "Qwen2MoeForCausalLM":
        assert (cfg.num_experts, cfg.experts_per_token, cfg.shared_expert_intermediate_size) == (6, 2, 40)
        assert cfg.dense_layers == (1,) and not cfg.normalize_expert_weights and cfg.qkv_bias
    elif cfg.architecture == "Qwen3ForCausalLM":
        assert cfg.qk_norm and not cfg.qkv_bias and (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (6, 2, 16)
        assert w.info.bos_token_id is None and cfg.tie_word_embeddings
    else:
        assert w.runner.model.config.sliding_window == 16 and w.info.bos_token_id == 1


def test_family_each_prompt_alone_matches_transformers(family: tuple[Worker, dict[int, list[int]]]) -> None:
    w, want = family
    for rid, prompt in PROMPTS.items():
        d = Driver(w.runner)
        d.prefill({rid: prompt}, greedy(FAMILY_NEW), 4)
        d.decode_to_end(4)
        assert d.outputs[rid] == want[rid], f"prompt {rid}"


def test_family_batched_and_chunked_match_transformers(family: tuple[Worker, dict[int, list[int]]]) -> None:
    """All prompts at once, each prefilled 11 tokens per plan alongside the others' decodes (with
    Mistral's window, chunks after the first start past the window)."""
    w, want = family
    d = Driver(w.runner)
    d.plan([(rid, min(11, len(p))) for rid, p in PROMPTS.items()],
           [NewRequest(rid, p, len(p), greedy(FAMILY_NEW)) for rid, p in PROMPTS.items()])
    while d.live():
        rows = [(rid, min(11, len(w.runner.seqs[rid].token_ids) - w.runner.seqs[rid].num_computed)) for rid in d.live()]
        d.plan(rows, steps=3)
    assert d.outputs == want


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_tensor_parallel_ranks_each_hold_a_share_of_every_expert(family: str, tmp_path: Path) -> None:
    """Two ranks' mixtures of experts (every expert's rows split, the router whole; Qwen2-MoE's
    shared expert split alike, its gate whole), summed as the all-reduce sums them, give the
    whole model's."""
    from worker.model.config import LlamaConfig
    from worker.model.llama import SparseMoE
    from worker.model.loader import load_model
    from worker.model.sharding import ShardLayout

    ckpt = FAMILIES[family](tmp_path / "moe")
    cfg = LlamaConfig.from_file(ckpt / "config.json")
    cpu = torch.device("cpu")
    whole = load_model(ckpt, cfg, torch.float32, cpu, 64)
    ranks = [load_model(ckpt, cfg, torch.float32, cpu, 64, layout=ShardLayout(cfg, r, 2)) for r in range(2)]
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    moe = whole.model.decoder_layers()[0].mlp
    parts = [r.model.decoder_layers()[0].mlp for r in ranks]
    assert isinstance(moe, SparseMoE) and all(isinstance(p, SparseMoE) for p in parts)
    assert [p.mlps()[0].inter for p in parts] == [cfg.expert_intermediate_size // 2] * 2
    if cfg.shared_expert_intermediate_size:
        assert [p.mlps()[-1].inter for p in parts] == [cfg.shared_expert_intermediate_size // 2] * 2
    with torch.inference_mode():
        assert torch.allclose(sum(p(x) for p in parts), moe(x), atol=1e-5)


def test_gemma2_config_without_its_caps_takes_gemma2s_defaults(tmp_path: Path) -> None:
    """A Gemma 2 config.json that leaves out the soft-caps and the window means Gemma2Config's
    defaults (50, 30, 4096), as in transformers; an explicit null means no cap."""
    from worker.model.config import LlamaConfig

    ckpt = save_gemma2(tmp_path / "g2")
    raw = json.loads((ckpt / "config.json").read_text())
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window", "layer_types"):
        raw.pop(key)
    (ckpt / "config.json").write_text(json.dumps(raw))
    cfg = LlamaConfig.from_file(ckpt / "config.json")
    assert (cfg.attention_softcap, cfg.final_logit_softcapping, cfg.layer_windows[:2]) == (50.0, 30.0, (4096, 0))
    (ckpt / "config.json").write_text(json.dumps(raw | {"attn_logit_softcapping": None}))
    assert LlamaConfig.from_file(ckpt / "config.json").attention_softcap == 0.0


def test_tensor_parallel_refuses_norms_across_heads(tmp_path: Path) -> None:
    """OLMoE's q/k norms take every head at once: split across ranks, each would see only its own."""
    from worker.model.config import LlamaConfig, ModelLoadError
    from worker.model.sharding import ShardLayout

    cfg = LlamaConfig.from_file(save_olmoe(tmp_path / "olmoe") / "config.json")
    with pytest.raises(ModelLoadError, match="q/k norms span every head"):
        ShardLayout(cfg, 0, 2)


ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 24.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_scalings_match_transformers(kind: str, tmp_path: Path) -> None:
    """A prompt of 40 tokens, then greedy decoding to position 99, past the trained 64 (32 for YaRN): dynamic NTK
    rescales its base at every later position as transformers does for a sequence that long
    (token by token, as its cached generation runs), YaRN interpolates some frequencies and scales
    cos and sin, linear divides every position."""
    trained = 128 if kind == "yarn" else 64  # YaRN's configs give the stretched length (32 x 4)
    ckpt = save_llama_checkpoint(tmp_path / kind, seed=2, rope_scaling=ROPE_SCALINGS[kind],
                                 max_position_embeddings=trained)
    prompt = PROMPTS[3][:40]
    want = hf_greedy(ckpt, [prompt], 60)[0]  # to position 99
    w = Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8, dtype="float32"))
    assert w.max_model_len == {"linear": 160, "yarn": 128, "dynamic": 192}[kind]  # stretched, as vLLM derives it
    d = Driver(w.runner)
    d.prefill({0: prompt}, greedy(60), 4)
    d.decode_to_end(4)
    assert d.outputs[0] == want


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_prompts_past_the_original_context_read_the_long_factors(partial: float, tmp_path: Path) -> None:
    """A prompt longer than LongRoPE's original 32 positions is rotated with the long factors
    throughout, as transformers rotates it; a short one with the short factors (the family
    tests). Logits of every position of a 70-token prompt, against transformers' forward."""
    from transformers import AutoModelForCausalLM

    ckpt = save_phi3(tmp_path / "phi", partial)
    w = Worker(WorkerConfig(model=str(ckpt), num_kv_blocks=64, block_size=8, dtype="float32"))
    prompt = PROMPTS[3]
    runner = w.runner
    positions = list(range(len(prompt)))
    meta = SdpaBackend(runner.device).build(runner.cache, [list(range(9))], [0], [len(prompt)], positions)
    meta.rope_offsets = torch.full((len(prompt),), runner.model.rotary.long_offset)
    with torch.inference_mode():
        got = runner.model(torch.tensor(prompt), meta)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert torch.allclose(got, want, atol=1e-4)
    d = Driver(runner)  # and the runner picks the long table for this request by itself
    d.prefill({0: prompt}, greedy(8), 4)
    d.decode_to_end(4)
    assert d.outputs[0] == hf_greedy(ckpt, [prompt], 8)[0]
