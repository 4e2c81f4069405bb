"""A ready-to-run worker, built from a ``WorkerConfig``: the model loaded, the KV cache sized and
allocated, the runner, and the ``ModelInfo`` to announce. No sockets: tests and benchmarks
drive ``Worker(config).runner`` in-process, exactly as the process loop does."""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import time

import msgspec
import torch
from tokenizers import Tokenizer

from protocol.config import WorkerConfig
from protocol.heap import return_freed_memory
from protocol.messages import ModelInfo, NewRequest, SamplingParams, StepPlan
from worker import cpu_isa
from worker.attention import CpuPagedBackend, SdpaBackend
from worker.draft_model import DraftModel
from worker.gguf.checkpoint import GGUFCheckpoint
from worker.gpu_memory import cuda_kv_blocks
from worker.kernels import cpu as cpu_kernels
from worker.kv_cache import KVCache, bytes_per_block, num_blocks_for, sizing_reason
from worker.model import cpu_matmul
from worker.model.config import LlamaConfig, ModelLoadError
from worker.model.cpu_decoder import CpuDecoder
from worker.model.info import build_gguf_model_info, build_model_info
from worker.model.loader import (
    is_gguf,
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
    resolve_max_model_len,
    resolve_model_dir,
    served_name,
)
from worker.model.sharding import ShardLayout
from worker.ngram import NgramConfig
from worker.parallel import TensorParallelGroup
from worker.runner import ModelRunner
from worker.sampling_defaults import sampling_defaults
from worker.structured import GrammarEngine

log = logging.getLogger("sluice.worker")

WARMUP_RID = -1  # and -2: rids the frontend assigns are >= 0


class Worker:
    def __init__(self, config: WorkerConfig, group: TensorParallelGroup | None = None) -> None:
        """``group``: this worker is one rank of a tensor-parallel group (``worker.parallel``),
        which loads and runs its part of the model."""
        self.config = config
        self.group = group
        self.device = resolve_device(config.device, config.rank if group is not None else None)
        if self.device.type == "cuda":
            # Events, streams and pinned-copy fences are made on the current device: without this,
            # a worker on cuda:1 records its staging events on cuda:0 while its copies run on
            # cuda:1, and a pinned buffer can be refilled while its copy is still in flight.
            torch.cuda.set_device(self.device)
        began = time.perf_counter()
        source = resolve_model_dir(config.model)
        log.info("loading %s on %s", source, self.device)
        gguf = GGUFCheckpoint(source) if is_gguf(source) else None
        config_file = source if gguf is not None else source / "config.json"
        cfg = gguf.config if gguf is not None else LlamaConfig.from_file(config_file)
        self.max_model_len = resolve_max_model_len(cfg, config.max_model_len, config_file)
        dtype, why = resolve_dtype(config.dtype, self.device, cfg)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, self.device)
        keep_quantized = gguf is not None and self._keeps_quantized(gguf, config.dtype)
        log.info("dtype: %s (%s)%s", str(dtype).removeprefix("torch."), why,
                 "; quantized weights stay quantized" if keep_quantized else "")
        for line in dtype_caveats(config.dtype, dtype, self.device, gguf.quantized_types() if gguf else []):
            log.warning("%s", line)
        layout = None
        if group is not None:
            layout = ShardLayout(cfg, group.rank, group.size)
            group.check_same({"model": f"{cfg.architecture}: {cfg.num_layers} layers, hidden size {cfg.hidden_size}, "
                                       f"{cfg.num_heads} heads, vocabulary {cfg.vocab_size}",
                              "dtype": str(dtype).removeprefix("torch.") + (" (quantized kept)" if keep_quantized else ""),
                              "--block-size": str(config.block_size), "--max-model-len": str(self.max_model_len)})
            log.info("tensor parallel: %s", layout.describe())
        reader = functools.partial(gguf.weights, keep_quantized=keep_quantized) if gguf is not None else None
        # A weight kept quantized is packed for the kernel as it is read: the load never holds
        # every weight's unpacked codes (a byte a weight) at once.
        pack = cpu_matmul.pack_layer if keep_quantized and self.device.type == "cpu" else None
        model = load_model(source, cfg, dtype, self.device, max_positions=self.max_model_len, weights=reader,
                           layout=layout, pack=pack)
        return_freed_memory()  # the checkpoint's separate parts, now fused
        self.num_params, weight_bytes = model.size()
        quantization = model.quantized_formats()
        if self.device.type == "cpu":
            model.use_cpu_kernels()
            log.info("linear layers: %s", cpu_matmul.prepare(model, dtype))
            if gguf is not None and gguf.kept_bytes:
                records = cpu_matmul.quantized_bytes(model)
                log.info("quantized weights: %.1f MiB in the kernel's records, %.1f MiB in the file (%.2fx): what a "
                         "decode step reads", records / 2**20, gguf.kept_bytes / 2**20, records / gguf.kept_bytes)
            if group is None:
                model.cpu_decoder = CpuDecoder.for_model(model)
        if group is not None and layout is not None:
            model.use_tensor_parallel(group, layout.vocab_start, cfg.vocab_size)
        if gguf is not None:
            gguf.file.release_pages()  # every weight is copied out by now
        return_freed_memory()
        log.info("loaded %s (%s, %.1fM parameters, %.0f MiB of weights) on %s as %s in %.1f s", source,
                 cfg.architecture, self.num_params / 1e6, weight_bytes / 2**20, self.device,
                 str(dtype).removeprefix("torch.") + (f", {quantization} kept quantized" if quantization else ""),
                 time.perf_counter() - began)
        kv_heads = model.config.num_kv_heads  # this rank's, under tensor parallelism
        per_block = bytes_per_block(cfg.num_layers, config.block_size, kv_heads, cfg.head_dim, kv_dtype)
        def make_cache(num_blocks: int) -> KVCache:
            return KVCache(cfg.num_layers, num_blocks, config.block_size, kv_heads, cfg.head_dim, kv_dtype, self.device)

        if self.device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory == "auto":
            def run_plan(trial: KVCache, plan: StepPlan) -> bool:
                """Run the profiling plan; whether attention read the cache in place."""
                runner = ModelRunner(model, trial, self.device, self.max_model_len, cfg.eos_token_ids,
                                     config.max_num_seqs)
                for _ in runner.execute(plan):
                    pass
                return not isinstance(runner.attention, SdpaBackend)

            num_blocks, sizing = cuda_kv_blocks(self.device, config.gpu_memory_utilization, per_block, make_cache,
                                                run_plan, config.max_num_batched_tokens, config.max_num_seqs,
                                                self.max_model_len, config.block_size)
        else:
            num_blocks = num_blocks_for(config, per_block, self.max_model_len)
            sizing = sizing_reason(config)
        if group is not None:  # the scheduler counts blocks for the whole group: each rank holds every one
            fewest = group.min_int(num_blocks)
            if fewest < num_blocks:
                sizing += f"; {num_blocks} fit here, {fewest} on the group's smallest rank"
            num_blocks = fewest
        cache = make_cache(num_blocks)
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB of %s (%s)", num_blocks, config.block_size,
                 num_blocks * config.block_size, cache.nbytes / 2**20, str(kv_dtype).removeprefix("torch."), sizing)
        name = config.served_model_name or served_name(config.model)
        if gguf is not None:
            self.info: ModelInfo = build_gguf_model_info(gguf, cfg, name=name, max_model_len=self.max_model_len,
                                                         num_kv_blocks=num_blocks, block_size=config.block_size)
        else:
            self.info = build_model_info(source, cfg, name=name, max_model_len=self.max_model_len,
                                         num_kv_blocks=num_blocks, block_size=config.block_size)
        self.info = msgspec.structs.replace(self.info, dtype=str(dtype).removeprefix("torch."),
                                            quantization=quantization,
                                            kv_cache_dtype="" if kv_dtype == dtype else str(kv_dtype).removeprefix("torch."),
                                            tensor_parallel_size=group.size if group is not None else 1)
        defaults, origin = sampling_defaults(config.model, source, config.generation_config)
        if defaults:
            self.info = msgspec.structs.replace(self.info, sampling_defaults=defaults, sampling_defaults_from=origin)
            log.info("sampling defaults from %s: %s (a request's own values win; --generation-config none for "
                     "OpenAI's)", origin, ", ".join(f"{k} {v:g}" for k, v in defaults.items()))
        # The host-copy buffer is sized for the most rows a step can have.
        grammars = GrammarEngine(self.info.tokenizer_json, self.info.vocab_size, self.info.eos_token_ids)
        ngram = NgramConfig(config.num_speculative_tokens, config.ngram_min, config.ngram_max) \
            if config.speculative == "ngram" else None
        draft = self._draft_model(num_blocks) if config.speculative == "draft" else None
        self.runner = ModelRunner(model, cache, self.device, self.max_model_len, self.info.eos_token_ids,
                                  config.max_num_seqs, grammars=grammars, jump_forward=config.jump_forward, ngram=ngram,
                                  draft=draft)
        if kv_dtype != dtype and not isinstance(self.runner.attention, CpuPagedBackend):
            raise ModelLoadError(f"--kv-cache-dtype {config.kv_cache_dtype}: only Sluice's CPU attention kernels read "
                                 f"a cache in another dtype than the model's, and this model takes "
                                 f"{self.runner.attention.name} (the start-up log says why); use --kv-cache-dtype auto")

    def _draft_model(self, num_blocks: int) -> DraftModel:
        """``--speculative-model``, loaded as ``--model`` is (the same device and dtype flags), with
        a KV cache of as many blocks: a request's draft KV sits at its target KV's block ids."""
        config = self.config
        if self.device.type == "cuda" and config.num_kv_blocks is None:
            # The model's cache took its share of the device before the draft loads.
            raise ModelLoadError("--speculative-model on a GPU needs --num-kv-blocks: the KV cache is sized from "
                                 "free memory before the draft model (its weights and its own cache of as many "
                                 "blocks) loads")
        log.info("speculative decoding: loading the draft model %s", config.speculative_model)
        draft = Worker(dataclasses.replace(config, model=config.speculative_model, speculative="none",
                                           speculative_model="", num_kv_blocks=num_blocks, max_model_len=None,
                                           served_model_name=None, kv_cache_memory="auto"))
        mine, theirs = (Tokenizer.from_str(info.tokenizer_json).get_vocab() for info in (self.info, draft.info))
        if mine != theirs:
            raise ModelLoadError(f"--speculative-model {config.speculative_model}: its tokenizer is not the model's "
                                 f"({len(theirs)} tokens against {len(mine)}, or the same ids for other text); a "
                                 "draft model must share the model's tokenizer")
        return DraftModel(draft.runner, config.num_speculative_tokens, config.max_num_batched_tokens)

    def _keeps_quantized(self, gguf: GGUFCheckpoint, dtype_flag: str) -> bool:
        """A quantized GGUF file is served quantized, as llama.cpp serves it, under ``--dtype auto``
        on a CPU whose quantized kernel runs (AVX-512 VNNI or AVX2); a named ``--dtype`` dequantizes it."""
        types = gguf.quantized_types()
        if not types or dtype_flag != "auto":
            return False
        if self.device.type != "cpu":
            log.info("%s weights are dequantized at load: the quantized kernels are the CPU's", ", ".join(types))
            return False
        if not cpu_kernels.has_quantized_linear(cpu_kernels.load()):
            log.info("%s weights are dequantized at load: the quantized kernel needs AVX-512 VNNI or AVX2, which this "
                     "CPU (or build) lacks", ", ".join(types))
            return False
        return True

    def warm_up(self) -> None:
        """A two-step window of a greedy row and a sampled one (temperature, top-k, top-p,
        logprobs), so the first requests do not pay for lazy initialisation: a prefill step, a
        decode step (on a GPU: its attention kernels' first compilation), random sampling and the
        logprob path all run once before the worker says it is ready. It writes into block 0,
        which no request holds yet; a request always writes a position before it reads it."""
        log.info("warming up")
        bs = self.config.block_size
        steps = 2 if bs >= 3 and self.max_model_len >= 4 else 1
        n = max(1, min(bs - steps, self.max_model_len - 1 - steps, 8))
        rows = [SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=steps, temperature=0.8, top_k=20, top_p=0.9, logprobs=2, seed=0,
                               ignore_eos=True)]
        rids = [WARMUP_RID - i for i in range(len(rows))]
        news = [NewRequest(rid, list(range(1, n + 1)), n, sampling) for rid, sampling in zip(rids, rows, strict=True)]
        plan = StepPlan(-1, news, rids, [n] * len(rids), [[0]] * len(rids), num_steps=steps)
        for _ in self.runner.execute(plan):
            pass
        for rid in rids:
            self.runner.forget(rid)
        # What loading made (modules, the tokenizer, grammar tables) lives as long as the worker:
        # frozen, so the collections the steps' short-lived objects trigger never walk it again
        # (they were 2% of a one-row decode step's profile).
        gc.collect()
        gc.freeze()
        return_freed_memory()  # what building the model's description, its tokenizer and the warm-up freed


def dtype_caveats(flag: str, dtype: torch.dtype, device: torch.device, quantized_types: list[str]) -> list[str]:
    """What a named ``--dtype`` does that its user may not expect, one line each for the start-up
    log: a quantized file dequantized, and dtypes a CPU runs without Sluice's kernels."""
    if flag == "auto":
        return []
    name = str(dtype).removeprefix("torch.")
    lines = []
    if quantized_types:
        lines.append(f"--dtype {flag}: the file's {', '.join(quantized_types)} weights are dequantized to {name} at "
                     "load (more memory; --dtype auto keeps them quantized where Sluice's quantized kernel runs)")
    if device.type == "cpu" and dtype == torch.float16:
        lines.append("--dtype float16 on a CPU: none of Sluice's CPU kernels take float16, so every operator runs "
                     "in torch, several times slower than bfloat16 or float32")
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_isa.has_bf16_instructions():
        if cpu_matmul.can_pack():
            lines.append("--dtype bfloat16 on a CPU without bfloat16 instructions (AVX512-BF16 or AMX): Sluice's "
                         "kernels widen it to float32 in registers (half the weight bytes of float32, float32's "
                         "arithmetic plus a rounding per operator)")
        else:
            lines.append("--dtype bfloat16 on a CPU without bfloat16 instructions (AVX512-BF16 or AMX) nor AVX2 "
                         "for Sluice's kernels: every product runs in torch, several times slower than float32")
    return lines

