"""Structured output, the API side: what a request asks to hold its output to, as one grammar.

A request names at most one constraint, in any of the shapes clients send:

* OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* vLLM's ``structured_outputs``: ``{"json": schema}``, ``{"regex": str}``, ``{"choice": [str]}``,
  ``{"grammar": EBNF/GBNF/Lark}``, ``{"json_object": true}``;
* vLLM's older flat fields ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

Each becomes an llguidance grammar (its JSON text), validated here against the model's tokenizer
with the engine's limits, off the event loop on a thread of its own and within
``COMPILE_TIMEOUT_S`` — a constraint that does not compile is a 400 naming the field, before the
request costs the engine anything (``GrammarValidator``).
Validated grammars are remembered (a bounded LRU keyed by the grammar's text), so a schema sent
again costs a dictionary look-up. The worker compiles the same text into its matcher
(``worker/structured.py``).

llguidance, not xgrammar: both are what vLLM and SGLang use, and both held SmolLM2's masks to a
few microseconds a token here; llguidance has no dependencies (xgrammar brings transformers and
triton, several GB), see docs/structured-output.md's figures.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import json
import time
from typing import Any

import llguidance
import msgspec

from frontend.errors import APIError, bad_request
from protocol.background import lower_thread_priority
from protocol.messages import ModelInfo

COMPILE_TIMEOUT_S = 5.0
MAX_PENDING = 64  # grammars queued or being checked; past this a request gets a 503 to retry
CACHE_SIZE = 256
MAX_SPEC_CHARS = 1 << 20  # a constraint's text: more than any real schema, less than a flood


def parser_limits() -> llguidance.LLParserLimits:
    """What one grammar may cost, here and in the worker: a schema built to explode the compiler
    (deep nesting, huge lexers) fails against these instead of taking the server's time."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000, max_items_in_row=2_000,
                                     initial_lexer_fuel=500_000, step_lexer_fuel=100_000, step_max_items=20_000)


class Constraint(msgspec.Struct, frozen=True):
    """One request's constraint: the field it came from (errors name it) and its grammar."""

    param: str
    grammar: str


# JSON is written as ``json.dumps`` writes it: one line, ", " and ": " between items. A model
# free to choose its whitespace can ramble in it (small models write newlines until max_tokens),
# and fixed whitespace leaves keys and punctuation with one continuation, which the worker then
# appends without a forward pass each (jump-forward). A schema's own "x-guidance" settings win.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def compact(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with ``JSON_LAYOUT`` unless it sets its own."""
    return {**schema, "x-guidance": JSON_LAYOUT | dict(schema.get("x-guidance") or {})}


# Subschemas an object's properties may sit under (JSON Schema 2020-12 and draft 7's names).
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties")


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its ``properties`` and says nothing of others closed
    to them (``additionalProperties: false``), as vLLM's default grammar engine (xgrammar's strict
    mode) and OpenAI's strict schemas read it. JSON Schema's own default lets a model add keys of
    its choosing, and a small one does, until ``max_tokens``: a plain Pydantic model's schema would
    never end. A schema that wants other keys says ``additionalProperties`` itself. The branches
    of an ``allOf`` are left open: each lists only part of the object's keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    if (isinstance(out.get("properties"), dict) and "allOf" not in out
            and not any(k in out for k in ("additionalProperties", "unevaluatedProperties", "patternProperties"))):
        out["additionalProperties"] = False
    return out


def _json_schema(value: Any, param: str) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise bad_request(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"{param} must be a JSON schema (an object)", param)
    if isinstance(value, dict):
        if not isinstance(value.get("x-guidance", {}), dict):
            raise bad_request(f"{param}.x-guidance must be an object (llguidance's JSON options)",
                              f"{param}.x-guidance")
        value = compact(closed(value))
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(json.dumps(value)))
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None


def _grammar(kind: str, value: Any, param: str) -> str:
    if kind in ("json", "json_schema"):
        return _json_schema(value, param)
    if kind == "json_object":
        return _json_schema({"type": "object"}, param)
    if kind == "regex":
        if not isinstance(value, str):
            raise bad_request(f"{param} must be a string (a regular expression)", param)
        return str(llguidance.LLMatcher.grammar_from_regex(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad_request(f"{param} must be a non-empty list of strings", param)
        return str(llguidance.grammar_from("choice", json.dumps(value)))
    if not isinstance(value, str):
        raise bad_request(f"{param} must be a string (an EBNF, GBNF or Lark grammar)", param)
    try:
        return str(llguidance.grammar_from("grammar", value))
    except ValueError as e:
        raise bad_request(f"{param}: {e}", param) from None


def _from_response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("response_format", _grammar("json_object", None, "response_format"))
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format.json_schema.schema is required (the JSON schema to follow)",
                              "response_format.json_schema.schema")
        return Constraint("response_format", _grammar("json", spec["schema"], "response_format.json_schema.schema"))
    raise bad_request(f"response_format.type {kind!r} is not one of text, json_object, json_schema",
                      "response_format.type")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_ALIASES = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def constraint_of(response_format: dict[str, Any] | None, structured: dict[str, Any] | None,
                  guided: dict[str, Any]) -> Constraint | None:
    """The request's one constraint (None: free text). ``guided``: the ``guided_*`` fields set."""
    found: list[Constraint] = []
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise bad_request("response_format must be an object", "response_format")
        c = _from_response_format(response_format)
        if c is not None:
            found.append(c)
    if structured is not None:
        unknown = sorted(set(structured) - set(STRUCTURED_KINDS))
        if unknown:
            raise bad_request(f"structured_outputs.{unknown[0]} is not one of {', '.join(STRUCTURED_KINDS)}",
                              f"structured_outputs.{unknown[0]}")
        kinds = [k for k in STRUCTURED_KINDS if structured.get(k) not in (None, False)]
        if len(kinds) > 1:
            raise bad_request(f"structured_outputs sets {' and '.join(kinds)}: give exactly one",
                              "structured_outputs")
        if kinds:
            param = f"structured_outputs.{kinds[0]}"
            found.append(Constraint(param, _grammar(kinds[0], structured[kinds[0]], param)))
    for field, kind in GUIDED_ALIASES.items():
        if guided.get(field) is not None:
            found.append(Constraint(field, _grammar(kind, guided[field], field)))
    if len(found) > 1:
        raise bad_request(f"{found[0].param} and {found[1].param} both constrain the output: give exactly one",
                          found[1].param)
    c = found[0] if found else None
    if c is not None and len(c.grammar) > MAX_SPEC_CHARS:
        raise bad_request(f"{c.param} is too large ({len(c.grammar)} characters compiled; at most {MAX_SPEC_CHARS})",
                          c.param)
    return c


class GrammarValidator:
    """Validates grammars against the served model's tokenizer, remembering the verdicts.

    Checks run on an executor of their own (never the default one, which long prompts'
    tokenization uses), one at a time, at most ``MAX_PENDING`` queued: past that a request gets a
    503 with ``Retry-After`` rather than a wait without end. The same text asked for while its
    check runs waits for that check. A request waits ``COMPILE_TIMEOUT_S`` at most: if its
    grammar's own check ran that long, the grammar is refused (400); if it mostly waited behind
    others, it gets a 503 to retry, and the verdict, once the check ends, is remembered for the
    retry. Only verdicts are remembered, never a timeout: a valid schema that merely queued is
    not refused later."""

    def __init__(self) -> None:
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._for: ModelInfo | None = None
        self._verdicts: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._running: dict[str, asyncio.Future[str]] = {}  # grammar -> its check, queued or running
        self._started: dict[str, float] = {}  # grammar -> monotonic start of its check on the thread
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-check",
                                                           initializer=lower_thread_priority)

    def _llg_tokenizer(self, model: ModelInfo) -> llguidance.LLTokenizer:
        if self._tokenizer is None or self._for is not model:
            self._tokenizer = llguidance.LLTokenizer(model.tokenizer_json, n_vocab=model.vocab_size,
                                                     eos_token=list(model.eos_token_ids) or None)
            self._for = model
            self._verdicts.clear()
        return self._tokenizer

    def _check(self, grammar: str, model: ModelInfo) -> str:
        self._started[grammar] = time.monotonic()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._llg_tokenizer(model), limits=parser_limits())
        return messages[0] if is_error else ""

    def _remember(self, grammar: str, check: asyncio.Future[str]) -> None:
        """A check ended: its verdict is kept (whoever waited for it may have given up)."""
        self._running.pop(grammar, None)
        self._started.pop(grammar, None)
        if check.cancelled() or check.exception() is not None:
            return
        self._verdicts[grammar] = check.result()
        while len(self._verdicts) > CACHE_SIZE:
            self._verdicts.popitem(last=False)

    async def validate(self, constraint: Constraint, model: ModelInfo) -> None:
        """A 400 naming the field if ``constraint`` does not compile (or not within the limits);
        a 503 to retry if the checks are too many, or this one waited too long behind others."""
        grammar = constraint.grammar
        verdict = self._verdicts.get(grammar)
        if verdict is not None:
            self._verdicts.move_to_end(grammar)
        else:
            check = self._running.get(grammar)
            if check is None:
                if len(self._running) >= MAX_PENDING:
                    raise APIError(503, f"{len(self._running)} structured-output grammars are being checked; retry "
                                   "shortly", code="grammar_queue_full", headers={"Retry-After": "1"})
                loop = asyncio.get_running_loop()
                check = loop.run_in_executor(self._pool, self._check, grammar, model)
                self._running[grammar] = check
                check.add_done_callback(lambda done: self._remember(grammar, done))
            try:
                verdict = await asyncio.wait_for(asyncio.shield(check), COMPILE_TIMEOUT_S)
            except TimeoutError:
                started = self._started.get(grammar)
                if started is not None and time.monotonic() - started >= COMPILE_TIMEOUT_S / 2:
                    raise bad_request(f"{constraint.param} cannot be used: it did not compile within "
                                      f"{COMPILE_TIMEOUT_S:g} s", constraint.param) from None
                raise APIError(503, f"{constraint.param}: its grammar is still queued to be checked behind others; "
                               "retry shortly", code="grammar_queue_full", headers={"Retry-After": "1"}) from None
        if verdict:
            first = verdict.strip().splitlines()[0] if verdict.strip() else verdict
            raise bad_request(f"{constraint.param} cannot be used: {first}", constraint.param)
