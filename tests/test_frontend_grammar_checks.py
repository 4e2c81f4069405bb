"""The frontend's grammar checks alone (real llguidance, a small byte-level tokenizer): they run on
a thread of their own, a timeout is never remembered as a refusal, and a full queue is a 503 to
retry rather than a wait without end.

Before: checks ran on the default executor (shared with tokenizing long prompts), and a schema
that merely waited 5 s behind others was cached as "did not compile" and refused for good.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from fake_scheduler import model_info

from frontend import structured
from frontend.errors import APIError
from frontend.structured import Constraint, GrammarValidator, constraint_of

MODEL = model_info()


def schema_constraint(i: int) -> Constraint:
    c = constraint_of(None, {"json": {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}}}, {})
    assert c is not None
    return c


class GatedValidator(GrammarValidator):
    """Checks wait for ``gate`` before the real check: a queue that a test controls."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.checked: list[str] = []

    def _check(self, grammar: str, model):  # type: ignore[no-untyped-def]
        self.gate.wait(30)
        self.checked.append(grammar)
        return super()._check(grammar, model)


def test_a_grammar_that_waited_behind_others_gets_a_503_then_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 0.3)
    validator = GatedValidator()

    async def run() -> None:
        with pytest.raises(APIError) as refused:
            await validator.validate(schema_constraint(1), MODEL)
        assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
        validator.gate.set()
        deadline = time.monotonic() + 30
        while validator._running and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await validator.validate(schema_constraint(1), MODEL)  # its verdict came: valid
        assert len(validator.checked) == 1, "the retry used the remembered verdict"

    asyncio.run(run())


def test_the_same_grammar_asked_for_at_once_is_checked_once_and_bad_ones_are_400s() -> None:
    validator = GatedValidator()

    async def run() -> None:
        asks = [asyncio.ensure_future(validator.validate(schema_constraint(2), MODEL)) for _ in range(5)]
        await asyncio.sleep(0.05)
        validator.gate.set()
        await asyncio.gather(*asks)
        assert len(validator.checked) == 1
        bad = Constraint("structured_outputs.grammar", json.dumps({"grammars": [{"lark_grammar": "start: nope"}]}))
        with pytest.raises(APIError) as refused:
            await validator.validate(bad, MODEL)
        assert refused.value.status == 400 and refused.value.param == "structured_outputs.grammar"

    asyncio.run(run())


def test_a_full_queue_is_a_503_with_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(structured, "MAX_PENDING", 3)
    validator = GatedValidator()

    async def run() -> None:
        queued = [asyncio.ensure_future(validator.validate(schema_constraint(10 + i), MODEL)) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as refused:
            await validator.validate(schema_constraint(99), MODEL)
        assert refused.value.status == 503 and refused.value.code == "grammar_queue_full"
        validator.gate.set()
        await asyncio.gather(*queued)
        await validator.validate(schema_constraint(99), MODEL)  # room again

    asyncio.run(run())
