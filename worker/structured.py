"""Structured output in the worker: each constrained request's matcher, and its mask on the logits.

A request whose ``SamplingParams.grammar`` is set (an llguidance grammar the frontend built and
validated) gets a matcher when the worker first hears of it. Compiling happens on a thread of its
own, beside the request's prefill rather than inside the step: the matcher is needed only when
the request first samples, after that forward pass. A grammar seen before is not compiled again:
its compiled matcher is kept (a bounded LRU keyed by the grammar's text) and copied. A request
rebuilt after a preemption or a worker restart replays its outputs into the new matcher.

Before each step that samples a constrained row, the host fills that row's bitmask (one bit per
token: may it come next?) from its matcher, several rows at once on llguidance's own threads. On
CUDA the fill runs on a thread of its own (``masks_later``), started when the step is prepared:
it overlaps with the host building and launching the forward pass and with the device running
it, and the sampler waits for it only once the logits are queued; the masks then go to the
device from pinned memory (R x V/8 bytes). On a CPU, whose cores the forward pass keeps busy,
the masks are filled before it (``masks``). The sampler sets the logits of every other token to
-inf in place (``apply_masks_``), for all constrained rows at once, before anything else reads
them — greedy, sampled, top-k/top-p, penalties, and logprobs, which are therefore those of the
constrained distribution. After the step the matcher consumes the sampled token. The model's EOS
is allowed exactly when the grammar accepts, and is the only token left once the grammar is
complete, so a constrained request ends on EOS there (finish_reason "stop"), as the scheduler's
stop rule expects.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from protocol.background import lower_thread_priority

log = logging.getLogger("sluice.worker")

CACHE_SIZE = 128


def parser_limits() -> llguidance.LLParserLimits:
    """The frontend's limits (``frontend/structured.py``): what validated there compiles here."""
    return llguidance.LLParserLimits(max_grammar_size=200_000, max_lexer_states=100_000, max_items_in_row=2_000,
                                     initial_lexer_fuel=500_000, step_lexer_fuel=100_000, step_max_items=20_000)


class GrammarState:
    """One request's matcher, compiled on the grammar thread; the step waits for it only if it
    samples before compiling is done."""

    __slots__ = ("_future", "broken", "eos")

    def __init__(self, future: Future[llguidance.LLMatcher], eos: int) -> None:
        self._future = future
        self.eos = eos
        self.broken = False  # the matcher failed (it should not, under its own mask): EOS only

    @property
    def matcher(self) -> llguidance.LLMatcher:
        return self._future.result()

    def fill(self, mask_row: torch.Tensor) -> None:
        """This request's allowed next tokens into ``mask_row`` (int32, contiguous, on the host)."""
        matcher = self.matcher
        if self.broken or matcher.is_error():
            self._fail(matcher)
            mask_row.zero_()
            mask_row[self.eos // 32] = 1 << (self.eos % 32) if self.eos % 32 < 31 else -(1 << 31)
            return
        matcher.unsafe_compute_mask_ptr(mask_row.data_ptr(), mask_row.numel() * mask_row.element_size())

    def fill_after(self, mask_row: torch.Tensor, drafts: tuple[int, ...]) -> None:
        """``fill``, as the matcher would be after ``drafts`` (speculative decoding's proposed
        tokens before a row's position, each allowed: ``valid_prefix`` cut them), then back."""
        matcher = self.matcher
        consumed = 0 if self.broken or matcher.is_error() else matcher.try_consume_tokens(list(drafts))
        # (Where a draft is not allowed, the positions after it are never kept: any mask will do.)
        self.fill(mask_row)
        if consumed:
            matcher.rollback(consumed)

    def valid_prefix(self, tokens: list[int]) -> list[int]:
        """The longest prefix of ``tokens`` the grammar allows from here (nothing consumed)."""
        if self.broken or self.matcher.is_error():
            return []
        return tokens[: self.matcher.validate_tokens(tokens)]

    def consume(self, token: int) -> None:
        matcher = self.matcher
        if not self.broken and not matcher.consume_token(token):
            self._fail(matcher)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar allows only one way from here (a JSON key and its
        punctuation), consumed: jump-forward. llguidance gives the canonical tokenization of the
        forced text and leaves out its last tokens where a longer token could span the boundary
        with what the model writes next, so the output tokenizes as the model would write it."""
        if limit <= 0 or self.broken:
            return []
        matcher = self.matcher
        tokens: list[int] = matcher.compute_ff_tokens()[:limit]
        if tokens and not matcher.consume_tokens(tokens):
            self._fail(matcher)
            return []
        return tokens

    def _fail(self, matcher: llguidance.LLMatcher) -> None:
        if not self.broken:
            self.broken = True
            log.warning("a constrained request's matcher failed (%s); it ends at its next token",
                        matcher.get_error() or "unknown")


class GrammarEngine:
    """Compiles grammars for one model's tokenizer (built on first use) on a thread of its own.

    A request's matcher is a copy of its grammar's compiled one. Copying takes microseconds, so
    a grammar compiled already (the scheduler waits for ``prepare`` before it plans a request)
    gets its matcher at once, on the caller's thread: it never queues on the grammar thread
    behind other grammars still compiling."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._tokenizer_json = tokenizer_json
        self._tokenizer: llguidance.LLTokenizer | None = None  # the grammar thread's alone
        # Written by the grammar thread, read by the main one: the lock guards the dictionary
        # (never a compile).
        self._compiled: collections.OrderedDict[str, llguidance.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar", initializer=lower_thread_priority)
        self._executor: llguidance.LLExecutor | None = None  # fills several rows' masks at once
        self._mask_pool: ThreadPoolExecutor | None = None  # fills a step's masks beside its forward pass

    def start(self, grammar: str, outputs: list[int]) -> GrammarState:
        """A matcher for ``grammar`` that has consumed ``outputs`` (a request rebuilt after a
        preemption or a restart): now if the grammar is compiled, else on the grammar thread."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        if compiled is not None:
            ready: Future[llguidance.LLMatcher] = Future()
            ready.set_result(_copy(compiled, outputs))
            return GrammarState(ready, self.eos_token_ids[0])
        return GrammarState(self._pool.submit(self._matcher, grammar, list(outputs)), self.eos_token_ids[0])

    def prepare(self, grammar: str, done: Callable[[], None]) -> None:
        """Compile ``grammar`` on the grammar thread ahead of any request's first plan (the
        scheduler holds its requests back meanwhile); ``done`` is called on that thread when it is
        compiled, or failed to (a request then finds out at its first token, as it would anyway)."""
        self._pool.submit(self._compiled_matcher, grammar).add_done_callback(lambda _: done())

    def _compiled_matcher(self, grammar: str) -> llguidance.LLMatcher:
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self.eos_token_ids or None)
        compiled = llguidance.LLMatcher(self._tokenizer, grammar, limits=parser_limits())
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _matcher(self, grammar: str, outputs: list[int]) -> llguidance.LLMatcher:
        return _copy(self._compiled_matcher(grammar), outputs)

    def masks_later(self, states: list[GrammarState], pin: bool,
                    drafts: list[tuple[int, ...]] | None = None) -> Future[torch.Tensor]:
        """``masks(states)``, filled on the mask thread while the caller goes on (into pinned
        memory with ``pin``, for a non-blocking copy to the device). The caller must wait for it
        before any of these matchers consumes a token (the sampler does, before it samples)."""
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        out = torch.empty((len(states), (self.vocab_size + 31) // 32), dtype=torch.int32, pin_memory=pin)
        return self._mask_pool.submit(self.masks, states, out, drafts)

    def masks(self, states: list[GrammarState], out: torch.Tensor | None = None,
              drafts: list[tuple[int, ...]] | None = None) -> torch.Tensor:
        """[R, ceil(V / 32)] int32 (into ``out`` if given): each constrained row's allowed tokens,
        one bit per token. Several healthy rows are filled at once by llguidance's own thread pool
        (a mask inside a large enum or ``anyOf`` can take milliseconds); a broken row gets EOS alone.
        ``drafts[i]``: the proposed tokens before row i's position (speculative decoding; a
        request's later positions list its matcher again): its mask is the grammar's after them,
        filled one at a time (a matcher is in one state at once)."""
        mask = out if out is not None else torch.empty((len(states), (self.vocab_size + 31) // 32), dtype=torch.int32)
        after = drafts or [()] * len(states)
        healthy = [(state.matcher, i) for i, state in enumerate(states)
                   if not after[i] and not state.broken and not state.matcher.is_error()]
        if len(healthy) > 1:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            # llguidance.torch's fill_next_token_bitmask_par does just this call, but importing
            # that module decorates a function with torch.compile, which imports torch's
            # compiler stack: 116 MiB of the worker's memory and 1.6 s of its start, never used.
            assert mask.dtype == torch.int32 and mask.is_contiguous() and mask.device.type == "cpu"
            self._executor.unsafe_compute_mask_ptr(healthy, mask.data_ptr(), mask.shape[1] * 4, mask.shape[0])
            filled = {i for _, i in healthy}
        else:
            filled = set()
        for i, state in enumerate(states):
            if i not in filled:
                state.fill_after(mask[i], after[i]) if after[i] else state.fill(mask[i])
        return mask


def _copy(compiled: llguidance.LLMatcher, outputs: list[int]) -> llguidance.LLMatcher:
    """A request's own matcher from its grammar's compiled one, past the outputs it has."""
    matcher = compiled.deep_copy()
    if outputs:
        matcher.consume_tokens(outputs)
    return matcher


MASK_SCRATCH_BYTES = 16 << 20  # the boolean scratch ``apply_masks_`` expands one chunk of rows into
_BLOCKED_BITS: dict[torch.device, torch.Tensor] = {}


def _blocked_bits(device: torch.device) -> torch.Tensor:
    """[256, 8] bool: for each byte value, which of its 8 bits (lowest first) are clear."""
    table = _BLOCKED_BITS.get(device)
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(-1)
        table = _BLOCKED_BITS[device] = ((values >> torch.arange(8, dtype=torch.int32)) & 1 == 0).to(device)
    return table


def apply_masks_(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """Set to -inf, in place, every logit of row ``rows[j]`` that bitmask ``masks[j]`` does not
    allow (token ``32 w + 8 b + i`` is bit ``i`` of byte ``b`` of word ``w``: the words are
    little-endian on every device torch runs on), and every logit past the mask's last bit (a
    vocabulary wider than the tokenizer's: tokens no grammar can allow). ``rows`` is every row in
    order (0..B-1) or a subset; on the device of ``logits``, as ``masks`` is.

    Nothing the size of the logits is allocated when every row is constrained: the mask bytes are
    looked up in a table of their 8 bits, chunks of rows at a time (``MASK_SCRATCH_BYTES`` of
    booleans), and filled into the logits' own rows. A subset of rows is gathered, filled and put
    back, chunk by chunk: what it copies is those rows' logits, never the batch's.

    ``llguidance.torch.apply_token_bitmask_inplace`` does the same for contiguous rows through
    ``torch.compile`` (a C++ or Triton kernel compiled at its first call, in the serving path,
    and a compiler needed on a CPU): not used."""
    num, vocab = masks.shape[0], logits.shape[-1]
    covered = min(vocab, 32 * masks.shape[1])
    every = num == logits.shape[0]
    chunk = max(1, MASK_SCRATCH_BYTES // max(vocab, 1))
    table = _blocked_bits(masks.device)
    for first in range(0, num, chunk):
        part = masks[first : first + chunk]
        blocked = table[part.view(torch.uint8).int()].view(part.shape[0], -1)[:, :covered]
        if every:
            target = logits[first : first + part.shape[0]]
        else:
            index = rows[first : first + part.shape[0]]
            target = logits.index_select(0, index)
        target[:, :covered].masked_fill_(blocked, -torch.inf)
        if covered < vocab:
            target[:, covered:] = -torch.inf
        if not every:
            logits.index_copy_(0, index, target)
