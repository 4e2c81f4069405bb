"""vLLM's V1 scheduler on bench_scheduler.py's workloads: the other side of its same-run ratio.

Run with a Python that has vLLM 0.32 (docs/benchmarks.md says how to make a venv for it):

    V/bin/python scripts/bench_scheduler_vllm.py                 # vLLM alone: every scenario, 3 rounds
    V/bin/python scripts/bench_scheduler_vllm.py --scenarios e --rounds 1 --json vllm.json
    python scripts/bench_scheduler.py --vllm-python V/bin/python # side by side (runs this with --serve)

The scenarios, their requests (the same seeded token ids and max_tokens, ignoring EOS), their phases
and stop conditions are bench_scheduler.py's, imported: only the driver differs. vLLM's
``Scheduler`` is built as its engine core builds it, without a GPU or a model (a config.json is all
its ModelConfig reads): chunked prefill, block size 16, max model length 8192, a 2048-token budget,
256 seats, async scheduling off, the scenario's policy and prefix caching, a KV cache of the
scenario's size; stats on, as ``vllm serve`` has them by default. Per step ``schedule()`` and
``update_from_output()`` are timed; the ModelRunnerOutput between them is built untimed.

Where the two harnesses differ: vLLM hashes a prompt's blocks when its ``Request`` is built, which
its engine does as a request arrives, off the step, so they are not timed here (with the prefix
cache on, d's admission); Sluice hashes them in schedule(), timed.

--serve is bench_scheduler.py's protocol: a line ``{"vllm": version}`` once ready, then for each line
``{"scenario": name, "seed": n}`` on stdin a line ``{"phases": {...}, "wall_s": s}`` on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

# Before vLLM is imported: its INFO lines would bury the figures.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
import vllm
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig
from vllm.config import SchedulerConfig as VllmSchedulerConfig
from vllm.sampling_params import SamplingParams as VllmSamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

# bench_scheduler.py, beside this file; it puts the repository (protocol, scheduler) on the path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_scheduler as bench
from bench_scheduler import BLOCK_SIZE, MAX_MODEL_LEN, OUTPUT_TOKEN, Driver

from protocol.config import SchedulerConfig
from protocol.messages import AddRequest

# The least model vLLM's ModelConfig accepts: a Llama whose vocabulary holds the workloads' token ids
# (bench_scheduler.VOCAB) and whose context is the scenarios' max model length. No weights are read.
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 32000,
    "max_position_embeddings": MAX_MODEL_LEN, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": bench.EOS,
}


class Model:
    """vLLM's ModelConfig for MODEL_CONFIG, built once: it inspects the model, which takes seconds.
    Its directory lasts as long as the process (removed at exit)."""

    directory: tempfile.TemporaryDirectory[str] | None = None
    config: ModelConfig | None = None

    @classmethod
    def get(cls) -> ModelConfig:
        if cls.config is None:
            cls.directory = tempfile.TemporaryDirectory(prefix="bench-scheduler-vllm-")
            with open(os.path.join(cls.directory.name, "config.json"), "w") as f:
                json.dump(MODEL_CONFIG, f)
            cls.config = ModelConfig(model=cls.directory.name, skip_tokenizer_init=True,
                                     max_model_len=MAX_MODEL_LEN, dtype="float32")
        return cls.config


def vllm_config(config: SchedulerConfig, num_blocks: int) -> VllmConfig:
    """The scenario's configuration (Sluice's) as vLLM's: the same budget, seats, policy and prefix
    caching; chunked prefill on, async scheduling off (as the scenarios have it). The device is
    named ("cpu"): this vLLM build finds no platform of its own here, and the scheduler never uses it."""
    if config.async_scheduling or config.preemption_mode != "recompute":
        raise SystemExit("vLLM's side runs only synchronous scheduling and recompute preemption")
    scheduler = VllmSchedulerConfig(max_num_batched_tokens=config.max_num_batched_tokens,
                                    max_num_seqs=config.max_num_seqs, max_model_len=MAX_MODEL_LEN,
                                    is_encoder_decoder=False, enable_chunked_prefill=True,
                                    async_scheduling=False, policy=config.scheduling_policy)
    cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=config.enable_prefix_caching)
    vc = VllmConfig(model_config=Model.get(), scheduler_config=scheduler, cache_config=cache,
                    device_config=DeviceConfig(device="cpu"))
    vc.cache_config.num_gpu_blocks = num_blocks  # what the engine sets after profiling memory
    return vc


class VllmHarness(Driver):
    """vLLM's scheduler, and a worker that samples OUTPUT_TOKEN for every row whose prompt (or
    recomputed context) is complete at the step: the rows vLLM's model runner keeps a token for."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, requests: list[AddRequest]) -> None:
        super().__init__()
        # vLLM's block pool keeps one block aside (its null block): one more leaves it as many for
        # requests as Sluice's scheduler has.
        num_blocks += 1
        vc = vllm_config(config, num_blocks)
        kv_cache = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                                                          dtype=torch.float32))])
        self.sched = VllmScheduler(vllm_config=vc, kv_cache_config=kv_cache, block_size=BLOCK_SIZE,
                                   structured_output_manager=StructuredOutputManager(vc),
                                   log_stats=True)  # as `vllm serve` has it by default
        hasher = None
        if config.enable_prefix_caching:  # as vLLM's engine core hashes requests' blocks
            hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        for msg in requests:
            sampling = VllmSamplingParams(max_tokens=msg.sampling.max_tokens, ignore_eos=msg.sampling.ignore_eos)
            # Zero-padded ids: vLLM's priority queue breaks ties by id, as Sluice's does by rid.
            self.sched.add_request(Request(f"{msg.rid:06d}", msg.prompt_token_ids, sampling, None,
                                           arrival_time=msg.arrival_time, priority=msg.priority,
                                           block_hasher=hasher))
        self.last: SchedulerOutput | None = None
        self.num_preemptions = 0

    def step(self) -> int | None:
        sched = self.sched
        if not sched.has_unfinished_requests():  # as vLLM's engine core: no step without requests
            return None
        t0 = time.perf_counter_ns()
        out = sched.schedule()
        t1 = time.perf_counter_ns()
        self.last = out
        if not out.num_scheduled_tokens:
            raise RuntimeError("the scheduler has work but scheduled nothing")
        self.num_preemptions += len(out.preempted_req_ids or ())
        reply = self._run(out)
        t2 = time.perf_counter_ns()
        sched.update_from_output(out, reply)
        t3 = time.perf_counter_ns()
        return (t1 - t0) + (t3 - t2)

    def _run(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The model runner's reply: a token for the rows whose context is then complete, none for
        the others (a prefill chunk's sample is discarded). schedule() has already advanced each
        request's computed count and says whether it is still a prefill chunk."""
        requests = self.sched.requests
        req_ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            if requests[req_id].is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([OUTPUT_TOKEN])
                self.sampled.add(int(req_id))
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def all_decoding(self, num_requests: int) -> bool:
        counts = self.last.num_scheduled_tokens if self.last is not None else {}
        return len(counts) == num_requests and all(n == 1 for n in counts.values())

    def unfinished(self) -> int:
        return self.sched.get_num_unfinished_requests()

    def preemptions(self) -> int:
        return self.num_preemptions


def serve() -> None:
    """bench_scheduler.py's side: scenarios in on stdin, figures out on stdout. Anything else that
    writes to stdout (a library's print) goes to stderr, so the replies stay one JSON line each."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    Model.get()
    replies.write(json.dumps({"vllm": vllm.__version__}) + "\n")
    for line in sys.stdin:
        ask = json.loads(line)
        phases, wall_s = bench.run_scenario(ask["scenario"], ask["seed"], VllmHarness)
        replies.write(json.dumps({"phases": phases, "wall_s": wall_s}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=",".join(bench.SCENARIOS), help="comma-separated, of: a,b,c,d,e")
    p.add_argument("--rounds", type=int, default=3, help="runs of each scenario; figures are medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="FILE", help="also write the figures here")
    p.add_argument("--prefix-caching", action="store_true", help="the prefix cache on in every scenario")
    p.add_argument("--serve", action="store_true", help="be bench_scheduler.py's vLLM side (see above)")
    args = p.parse_args()
    if args.prefix_caching:
        bench.FORCED_CONFIG["enable_prefix_caching"] = True
    if args.serve:
        serve()
        return
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    if not names or any(s not in bench.SCENARIOS for s in names) or args.rounds < 1:
        p.error(f"--scenarios takes some of {','.join(bench.SCENARIOS)}; --rounds must be >= 1")
    print(f"vLLM {vllm.__version__}; cpu: {bench.cpu_model()}, {os.cpu_count()} cores; "
          f"load average at start {bench.load_average()}", flush=True)
    figures: dict[str, bench.Figures] = {}
    for _ in range(args.rounds):
        for name in names:
            bench.record(figures, *bench.run_scenario(name, args.seed, VllmHarness))
    print(f"{'scenario':<12} {'steps':>6} {'p50 us':>9} {'p90 us':>9} {'p99 us':>9} {'wall s':>7}")
    results = {phase: fig.medians() for phase, fig in figures.items()}
    for phase, fig in figures.items():
        print(f"{phase:<12} {int(fig.median('steps')):>6} "
              + " ".join(f"{fig.median(f'p{q}_us'):>9,.0f}" for q in (50, 90, 99)) + f" {fig.wall_s:>7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vllm": vllm.__version__, "rounds": args.rounds, "seed": args.seed,
                       "prefix_caching": args.prefix_caching, "cpu": bench.cpu_model(),
                       "load_average_end": bench.load_average(), "scenarios": results}, f, indent=2)


if __name__ == "__main__":
    main()
