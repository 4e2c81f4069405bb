"""Speculative decoding's flags: ``--speculative ngram`` and its numbers reach the scheduler's and
the worker's configs, and so does a draft model (``--speculative-model``); vLLM's
``--speculative-config`` JSON sets the same; anything Sluice does
not serve (another method, an unknown key, bad numbers) is a one-line error."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sluice_server import free_port

from frontend.cli import apply_speculative_config, build_config, build_parser, parse
from protocol.config import ConfigError, SchedulerConfig, WorkerConfig


def configs(*flags: str) -> tuple[SchedulerConfig, WorkerConfig]:
    args = parse(build_parser(), ["serve", *flags])
    apply_speculative_config(args)
    return build_config(SchedulerConfig, args), build_config(WorkerConfig, args)


def test_the_flags_reach_both_components() -> None:
    scheduler, worker = configs("--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "2",
                                "--ngram-max", "5", "--speculative-max-batch", "4")
    assert (scheduler.speculative, scheduler.num_speculative_tokens, scheduler.speculative_max_batch) == \
        ("ngram", 3, 4)
    assert (worker.speculative, worker.num_speculative_tokens, worker.ngram_min, worker.ngram_max) == \
        ("ngram", 3, 2, 5)
    scheduler, worker = configs()
    assert scheduler.speculative == worker.speculative == "none"  # off unless asked for


def test_vllms_speculative_config_sets_the_same() -> None:
    scheduler, worker = configs("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                                '"prompt_lookup_max": 3, "prompt_lookup_min": 2}')
    assert (scheduler.speculative, scheduler.num_speculative_tokens) == ("ngram", 5)
    assert (worker.speculative, worker.num_speculative_tokens, worker.ngram_min, worker.ngram_max) == \
        ("ngram", 5, 2, 3)


def test_a_draft_model_by_flag_or_by_vllms_config() -> None:
    for flags in (("--speculative-model", "/models/draft"),
                  ("--speculative-config", '{"model": "/models/draft", "num_speculative_tokens": 3}'),
                  ("--speculative-config", '{"method": "draft_model", "model": "/models/draft"}')):
        scheduler, worker = configs(*flags)
        assert scheduler.speculative == worker.speculative == "draft"
        assert worker.speculative_model == "/models/draft"
    assert configs("--speculative-config", '{"model": "d", "num_speculative_tokens": 3}')[1].num_speculative_tokens == 3
    with pytest.raises(ConfigError, match="go together"):
        configs("--speculative", "draft")
    with pytest.raises(ConfigError, match="go together"):
        configs("--speculative", "ngram", "--speculative-model", "/models/draft")


@pytest.mark.parametrize(("text", "says"), [
    ('{"method": "eagle", "model": "x"}', "method 'eagle' is not served"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 1}', "'draft_tensor_parallel_size'"),
    ("[1, 2]", "must be a JSON object"),
    ("{method: ngram}", "is not JSON"),
])
def test_what_is_not_served_is_refused(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        configs("--speculative-config", text)


@pytest.mark.parametrize("flags", [("--num-speculative-tokens", "0"), ("--ngram-min", "3", "--ngram-max", "2"),
                                   ("--speculative-max-batch", "-1")])
def test_bad_numbers_are_refused(flags: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError):
        configs("--speculative", "ngram", *flags)


def test_sluice_serve_says_it_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "frontend", "serve", "--model", "tiny", "--speculative-config",
                           '{"method": "medusa"}'], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "sluice: error: --speculative-config: method 'medusa' is not served; \"ngram\" (prompt lookup) and "
        "\"draft_model\" (with \"model\") are"]


def test_a_draft_model_with_another_tokenizer_is_refused_at_start_up() -> None:
    """The built-in tiny model's 512-token vocabulary is not SmolLM2's: the worker stops at load,
    and ``sluice serve`` says why in one line (a free port; nothing is left running)."""
    done = subprocess.run([sys.executable, "-m", "frontend", "serve", "--model", "smollm2", "--speculative-model",
                           "tiny", "--port", str(free_port()), "--num-kv-blocks", "64"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("sluice: error:")]
    assert len(errors) == 1 and "its tokenizer is not the model's" in errors[0], done.stderr[-2000:]
