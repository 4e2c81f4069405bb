"""When a request stops on token ids: one rule for the scheduler, the worker and the tests' fake worker.

The scheduler decides when a request finishes, but the worker decides on its own when to stop
a row inside a multi-step or speculative window (it emits nothing past the stop token and drops
the row), and ``tests/fake_worker.py`` stands in for the worker in the scheduler's tests. If
any two disagreed by one token, the worker would end rows the scheduler still plans for, or
produce tokens the scheduler never expects; so all three call these functions instead of each
spelling the rule out. Stop *strings* are not here: they are the frontend's.
"""

from __future__ import annotations

from collections.abc import Container

from protocol.messages import FinishReason, SamplingParams


def stop_reason(token: int, num_outputs: int, num_tokens: int, sampling: SamplingParams,
                eos_token_ids: Container[int], max_model_len: int) -> str | None:
    """The finish reason that ``token``, just appended, triggers; None when the request goes on.
    ``num_outputs`` and ``num_tokens`` (prompt + outputs) count ``token`` itself.

    A stop token id stops; an EOS stops unless ``ignore_eos``, once ``min_tokens`` outputs are
    reached; otherwise ``max_tokens`` outputs or ``max_model_len`` tokens end it for length."""
    if token in sampling.stop_token_ids:
        return FinishReason.STOP
    if not sampling.ignore_eos and token in eos_token_ids and num_outputs >= sampling.min_tokens:
        return FinishReason.STOP
    if length_reached(num_outputs, num_tokens, sampling, max_model_len):
        return FinishReason.LENGTH
    return None


def length_reached(num_outputs: int, num_tokens: int, sampling: SamplingParams, max_model_len: int) -> bool:
    """The newest token (counted in ``num_outputs`` and ``num_tokens``) stops the request
    whatever its id is: ``max_tokens`` outputs or ``max_model_len`` tokens. Decidable before
    the id is known, so a multi-step window knows in time to sample no further."""
    return num_outputs >= sampling.max_tokens or num_tokens >= max_model_len
