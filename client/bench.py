"""``sluice bench``: an asyncio load generator for any OpenAI-compatible server.

    sluice bench --num-prompts 200 --max-concurrency 32 --input-len 512 --output-len 32:256 --ignore-eos
    sluice bench --request-rate 8 --priority-mix 0:0.2,5:0.8 --admin-token T --plot-dir plots --save run.json
    sluice bench --scenario long-prefill --save long-prefill.json --plot-dir plots

With ``--scenario`` it starts its own ``sluice serve``, one per setting the scenario compares
(``client.scenarios``, ``client.compare``), and prints one comparison table.

Streams every request (``stream_options.include_usage``) and reports, overall and per priority
class, what ``vllm bench serve`` reports, defined as it defines them (``client.stream``,
``client.stats``): request and token throughput, TTFT, TPOT, ITL and end-to-end latency.

Each run draws a new seed unless ``--seed`` is given, and prints it. Ctrl-C stops the measured run
and reports, saves and plots the requests that finished (exit status 130; ``client.interrupt``).

This module is imported whenever any ``sluice`` command builds its parser, so its top level
imports only argparse, os and sys; the client modules (httpx, rich, matplotlib) load in ``run``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any


def _arg_type(parser_name: str) -> Any:
    """An argparse type from a ``client.workload`` parser, imported when a flag is parsed."""

    def convert(text: str) -> Any:
        from client import workload

        try:
            return getattr(workload, parser_name)(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parser_name.removeprefix("parse_")  # what argparse names in its errors
    return convert


def _positive(cast: type) -> Any:
    def convert(text: str) -> Any:
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be > 0")
        return value

    convert.__name__ = cast.__name__
    return convert


# Flags whose default is computed (or secret, from the environment) are left out of the namespace
# unless given: ``sluice bench --help`` then shows no misleading "(default: None)" and never prints
# a token. ``_resolve_defaults`` fills them in.
UNSET = argparse.SUPPRESS


DEFAULT_URL = "http://127.0.0.1:8000"
# client.scenarios.SCENARIOS' names, here so that building the parser imports nothing (a test
# checks that they agree).
SCENARIO_NAMES = ("long-prefill", "priority", "shared-prefix", "preemption", "json")
# Flags a scenario sets itself (dest -> flag): refused with --scenario rather than ignored.
WORKLOAD_FLAGS = {"model": "--model", "num_prompts": "--num-prompts", "max_concurrency": "--max-concurrency",
                  "request_rate": "--request-rate", "input_len": "--input-len", "output_len": "--output-len",
                  "token_ids": "--token-ids"}
SCENARIO_FLAGS = {"server_model": "--server-model", "server_args": "--server-args", "scale": "--scale"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="the server's base URL")
    p.add_argument("--model", default=UNSET, help="model name to send (default: the server's first, GET /v1/models)")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="POST /v1/completions or /v1/chat/completions (the prompt as one user message)")
    p.add_argument("--api-key", default=UNSET,
                   help="sent as Authorization: Bearer on /v1 requests (default: env OPENAI_API_KEY)")
    load = p.add_argument_group("load")
    load.add_argument("--num-prompts", type=_positive(int), default=UNSET, help="requests measured (default 100)")
    load.add_argument("--max-concurrency", type=_positive(int), default=UNSET,
                      help="most requests in flight at once (default: no limit)")
    load.add_argument("--request-rate", type=_positive(float), default=UNSET,
                      help="requests per second, arrivals drawn by --burstiness; inf = all at once (default inf)")
    load.add_argument("--burstiness", type=_positive(float), default=1.0,
                      help="shape of the gamma distribution of gaps between arrivals: 1 = Poisson, "
                           "< 1 burstier, > 1 more even")
    load.add_argument("--warmup", type=int, default=1,
                      help="requests sent and awaited before the measured run, not counted (if all "
                           "of them fail, the run does not start)")
    work = p.add_argument_group("workload")
    work.add_argument("--input-len", type=_arg_type("parse_length"), default=UNSET, metavar="N|LO:HI",
                      help="prompt tokens, fixed or drawn uniformly from LO..HI (default 256)")
    work.add_argument("--output-len", type=_arg_type("parse_length"), default=UNSET, metavar="N|LO:HI",
                      help="max_tokens, fixed or drawn uniformly from LO..HI (default 128)")
    work.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                      help='one {"prompt": str or [token ids], "output_len": int} per line, instead of '
                           "generated prompts (shuffled by --seed, cycled if too few)")
    work.add_argument("--token-ids", nargs="?", const="100:500", default=UNSET, type=_arg_type("parse_token_id_range"),
                      metavar="LO:HI", help="send prompts as token-id lists, ids drawn from LO..HI-1 (bare "
                                            "--token-ids: 100:500, valid in any vocabulary); completions only")
    work.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature sent with every request (default 0: greedy, as vllm bench serve "
                           "sends; a server's own default is often 1, random sampling, which costs a CPU server more)")
    work.add_argument("--ignore-eos", action="store_true",
                      help="send ignore_eos: true (vLLM, SGLang, Sluice) so every request generates max_tokens")
    work.add_argument("--priority-mix", type=_arg_type("parse_priority_mix"), default=None, metavar="P:F[,P:F...]",
                      help="send a priority field: 0:0.2,5:0.8 = 20%% of requests with priority 0, 80%% "
                           "with 5 (exact counts, seeded order); the report adds one column per class "
                           "(Sluice takes priorities < 0 only with the admin token: pass it as --api-key)")
    work.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                      help="every prompt starts with the same N-token prefix (prefix caching)")
    work.add_argument("--seed", type=int, default=None,
                      help="seeds prompts, lengths, priorities and arrivals: the same seed and flags send the same "
                           "workload (default: a new seed each run, printed at the start and saved in --save's "
                           "JSON, so that a second run is not answered from the server's prefix cache)")
    out = p.add_argument_group("output")
    out.add_argument("--save", default=None, metavar="FILE.json",
                     help="write the report, the configuration and every request's record as JSON (after "
                          'Ctrl-C: the requests that finished, with "completed": false)')
    out.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots into DIR")
    out.add_argument("--admin-token", default=UNSET,
                     help="sample Sluice's GET /admin/stats every 0.5 s for KV cache and queue plots "
                          "(default: env SLUICE_ADMIN_TOKEN)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take before it counts as failed (0 = no limit)")
    sc = p.add_argument_group(
        "scenarios", "compare server settings: start a sluice serve per setting, one after another, send each "
                     "the same seeded workload (token-id prompts, ignore_eos) and print one table; --url and the "
                     "load and workload flags do not apply (--seed, --warmup, --timeout, --save and --plot-dir do: "
                     "one plot folder per setting)")
    sc.add_argument("--scenario", choices=SCENARIO_NAMES, default=None,
                    help="long-prefill (vLLM's feature request for concurrent partial prefills: short prompts arriving behind 8000-token ones; "
                         "--min-concurrent-prefills 1 vs 2 vs no chunking); priority (vLLM's priority-scheduling RFC: "
                         "interactive requests amid a saturating batch load; --priority-preemption vs not); "
                         "shared-prefix (vLLM's prefix-cache-aware admission: prompts sharing 90%%; prefix caching "
                         "on vs off); preemption (vLLM's preemption guide: a KV cache a third of the demand; "
                         "--preemption-mode recompute vs swap); json (SGLang's jump-forward decoding: "
                         "JSON-constrained streams beside free ones; --jump-forward vs not)")
    sc.add_argument("--server-model", default=UNSET, help="--model of the scenario's servers (default smollm2)")
    sc.add_argument("--server-args", default=UNSET, metavar="FLAGS",
                    help="more sluice serve flags for every server, as one string after '=' (it starts with --): "
                         "--server-args='--dtype float32'; a setting's own flags come after, so they win")
    sc.add_argument("--scale", type=_positive(float), default=UNSET,
                    help="multiply the scenario's request counts, token lengths and arrival gaps (default 1: "
                         "1 to 3 minutes per scenario with SmolLM2 on 2 CPU cores)")


def _check_scenario(args: argparse.Namespace) -> str | None:
    given = vars(args)
    if not args.scenario:
        named = [flag for dest, flag in SCENARIO_FLAGS.items() if dest in given]
        return f"{', '.join(named)}: only with --scenario" if named else None
    named = [flag for dest, flag in WORKLOAD_FLAGS.items() if dest in given]
    named += [flag for flag, off in [("--dataset", args.dataset is None), ("--priority-mix", args.priority_mix is None),
                                     ("--shared-prefix", args.shared_prefix == 0),
                                     ("--endpoint", args.endpoint == "completions"),
                                     ("--burstiness", args.burstiness == 1.0)] if not off]
    if named:
        return f"--scenario {args.scenario} sets its own workload: drop {', '.join(named)}"
    if args.warmup < 0:
        return "--warmup must be >= 0"
    return None


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with a combination of flags, if anything."""
    if args.token_ids and args.endpoint == "chat":
        return "--token-ids needs --endpoint completions (chat messages are text)"
    if args.warmup < 0 or args.shared_prefix < 0:
        return "--warmup and --shared-prefix must be >= 0"
    if not args.dataset and args.shared_prefix and args.shared_prefix >= args.input_len.lo:
        return f"--shared-prefix {args.shared_prefix} leaves no room in --input-len (shortest {args.input_len.lo})"
    return None


def _resolve_defaults(args: argparse.Namespace) -> None:
    from client.workload import Length

    given = vars(args)
    if args.dataset and ("input_len" in given or "output_len" in given):
        raise ValueError("--dataset sets prompts and output lengths: drop --input-len/--output-len")
    defaults = {
        "model": None,
        "api_key": os.environ.get("OPENAI_API_KEY"),
        "admin_token": os.environ.get("SLUICE_ADMIN_TOKEN"),
        "max_concurrency": None,
        "num_prompts": 100,
        "request_rate": float("inf"),
        "server_model": "smollm2",
        "server_args": "",
        "scale": 1.0,
        "token_ids": None,
        "input_len": None if args.dataset else Length(256, 256),
        "output_len": None if args.dataset else Length(128, 128),
    }
    for name, value in defaults.items():
        given.setdefault(name, value)
    _resolve_seed(args)


def _resolve_seed(args: argparse.Namespace) -> None:
    """A seed drawn for this run unless --seed was given (``seed_drawn`` says which, in the JSON too)."""
    from client.workload import draw_seed

    args.seed_drawn = args.seed is None
    if args.seed_drawn:
        args.seed = draw_seed()


def seed_line(args: argparse.Namespace, what: str = "") -> str:
    if args.seed_drawn:
        return f"seed {args.seed}{what} (drawn for this run: --seed {args.seed} repeats its workload)"
    return f"seed {args.seed}{what} (--seed)"


def run(args: argparse.Namespace) -> int:
    if problem := _check_scenario(args):
        print(f"sluice bench: error: {problem}", file=sys.stderr)
        return 2
    if args.scenario:
        return _run_scenario(args)

    try:
        _resolve_defaults(args)
    except ValueError as e:
        print(f"sluice bench: error: {e}", file=sys.stderr)
        return 2
    if problem := _check(args):
        print(f"sluice bench: error: {problem}", file=sys.stderr)
        return 2
    from client.orchestrate import benchmark, finish
    from client.stream import run_loop

    print(seed_line(args), file=sys.stderr)
    return _exit_status(lambda: finish(args, run_loop(benchmark(args))), "no report")


def _run_scenario(args: argparse.Namespace) -> int:
    _resolve_defaults(args)
    if args.url != DEFAULT_URL:
        print(f"sluice bench: --url {args.url} ignored: --scenario starts its own servers", file=sys.stderr)
    from client.compare import run_scenario

    print(seed_line(args, " for every setting"), file=sys.stderr)
    return _exit_status(lambda: run_scenario(args), "no report (the servers were stopped)")


def _exit_status(run_it: Callable[[], int], interrupted: str) -> int:
    """``run_it()``'s status; a ``BenchError`` is one error line and 1. Ctrl-C during the measured
    run is ``run_it``'s to handle (it reports what finished and returns 130); before it, or a second
    one, is a note here and 130."""
    from client.interrupt import Interrupted
    from client.orchestrate import BenchError

    try:
        return run_it()
    except BenchError as e:
        print(f"sluice bench: error: {e}", file=sys.stderr)
        return 1
    except Interrupted:
        print(f"sluice bench: interrupted before the measured run; {interrupted}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print(f"sluice bench: interrupted; {interrupted}", file=sys.stderr)
        return 130
