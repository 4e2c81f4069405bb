"""The output processor: what the frontend does with every batch of tokens the scheduler sends.

The task that receives a ``TokenBatch`` runs ``OutputProcessor.process`` on it: one loop over the
batch in which every token goes through its request's incremental detokenizer and stop strings
and, for a streaming response, becomes the finished SSE chunk (rendered by the renderer chosen
when the request was admitted) appended to that response's buffer. The HTTP handler of each
response only writes what is buffered (``Output.take``): one write per wake-up, however many
chunks wait, so a client that lags gets them together. A client that lags far
(``COALESCE_AFTER`` chunks unsent) has its further text merged into one chunk per write, so a
slow reader costs its text, not a chunk per token. A non-streaming response collects its text
instead and is woken once, when its last choice ends.

An ``Output`` is one HTTP response: one ``Choice`` per engine request (``n`` of them, rids
``rid .. rid+n-1``). A choice is live in the processor from admission until it ends: its
scheduler finish arrived, a stop string matched (it is then aborted in the scheduler), or the
response's handle let it go (``EngineClient.release``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from frontend.metrics import Metrics
from frontend.reasoning import ReasoningParser
from frontend.render import Renderer, usage_dict
from frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer, StopStringMatcher
from protocol.messages import (
    AddRequest,
    Finish,
    FinishReason,
    Logprob,
    PromptLogprob,
    TokenBatch,
    unpack_embeddings,
    unpack_logprobs,
    unpack_prompt_logprobs,
)

log = logging.getLogger("sluice.frontend")

# Unsent chunks of one response beyond which its choices' text is merged (a stalled or slow
# client). Well above a window of jitter: a busy event loop can find a few dozen tokens at once,
# and clients that keep up must still see one chunk per token.
COALESCE_AFTER = 256


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """How token ids become a choice's text (vLLM's fields of those names)."""

    skip_special_tokens: bool = True
    include_stop: bool = False  # include_stop_str_in_output


class Choice:
    """One engine request's output: its text so far, and what it reports when it ends."""

    __slots__ = (
        "abort_sent", "arrivals", "cached_tokens", "completion_tokens", "detok", "ended", "first_chunk",
        "generated", "index", "logprobs", "output", "parts", "reasoning", "request_id", "rid", "silent_ids",
        "stops", "text_offset", "thought", "token_ids", "unsent_ids", "unsent_reasoning", "unsent_text",
    )  # fmt: skip

    def __init__(self, output: Output, index: int, rid: int, request_id: str, tokenizer: ModelTokenizer,
                 request: AddRequest, stop_strings: list[str], text: TextOptions,
                 reasoning: bool | None = None) -> None:
        self.output, self.index, self.rid, self.request_id = output, index, rid, request_id
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, text.skip_special_tokens)
        self.stops = StopStringMatcher(stop_strings, text.include_stop) if stop_strings else None
        # After stop strings: the think block's text (reasoning) told apart from the answer's.
        self.reasoning = ReasoningParser(reasoning) if reasoning is not None else None
        # Tokens that end generation (EOS, stop ids) are not part of the text, as in OpenAI's API.
        sampling = request.sampling
        self.silent_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self.silent_ids.update(tokenizer.info.eos_token_ids)
        self.completion_tokens = 0
        self.generated: list[int] = []  # every token id so far: what another engine continues from
        self.cached_tokens = 0
        self.arrivals: list[float] = []  # monotonic time each token reached the frontend
        self.first_chunk = True
        self.text_offset = 0  # completions' logprobs: the text offset of the next token
        self.ended = False  # its output is complete (or given up): nothing more is rendered
        self.abort_sent = False
        # Not streaming: the whole answer, collected. Streaming: a backlog merged into one chunk.
        self.parts: list[str] = []
        self.thought: list[str] = []  # the reasoning's parts
        self.token_ids: list[int] = []
        self.logprobs: list[Logprob] = []
        self.unsent_text: list[str] = []
        self.unsent_reasoning: list[str] = []
        self.unsent_ids: list[int] = []

    @property
    def prompt_logprobs(self) -> list[PromptLogprob] | None:
        """The prompt's logprobs (entry i for prompt token i + 1), once they arrived."""
        return self.output.prompt_logprobs

    def split(self, text: str, token_ids: list[int], last: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the next tokens' text; ``last``: with what was held back."""
        parser = self.reasoning
        assert parser is not None
        reasoning, text = parser.feed(text, len(token_ids))
        if last:
            held_reasoning, held_text = parser.flush()
            reasoning, text = reasoning + held_reasoning, text + held_text
        return reasoning, text


class Output:
    """One HTTP response (or one prompt's part of a completion with several): its choices, and
    what its writer has yet to send.

    Streaming: ``buffer`` holds SSE bytes in order; ``take`` waits for some and returns them all
    at once. Not streaming: ``done`` is set when every choice has ended."""

    def __init__(self, request: AddRequest, tokenizer: ModelTokenizer, stop_strings: list[str],
                 renderer: Renderer, streaming: bool, include_usage: bool, first_index: int = 0,
                 terminal: bool = True, text: TextOptions = TextOptions(), reasoning: bool | None = None,
                 tools: bool = False) -> None:
        """``reasoning``: None when the answer is text alone; else it is split into reasoning and
        content (``frontend.reasoning``), True when the prompt leaves the model inside ``<think>``.
        ``tools``: its text is read for tool calls."""
        self.request = request
        # Tags a parser reads that are special tokens: their text, which decoding skips, by id.
        self.hidden_tags = (tokenizer.hidden_think_tags if reasoning is not None else {}) \
            | (tokenizer.hidden_tool_tags if tools else {})
        self.renderer = renderer
        self.streaming = streaming
        self.include_usage = include_usage
        self.started = time.monotonic()
        # A completion with several prompts has one ``Output`` per prompt: ``first_index``
        # numbers their choices across them (prompt p's choice j is index p * n + j), and a
        # stream's usage chunk and [DONE] are its writer's to send once for all (``terminal``).
        self.terminal = terminal
        rid, request_id = request.rid, request.request_id
        self.choices = [Choice(self, first_index + i, rid + i, request_id if i == 0 else f"{request_id}-{i}",
                               tokenizer, request, stop_strings, text, reasoning) for i in range(request.n)]
        self.finishes: dict[int, Finish] = {}  # by choice index: the scheduler's word on how it ended
        # Echo with logprobs, or vLLM's prompt_logprobs: the prompt's, computed by the first
        # choice, reported for every choice.
        self.prompt_logprobs: list[PromptLogprob] | None = None
        self.embedding: bytes | None = None  # an embedding request's vector (float32 bytes), once it came
        self.reasons: dict[int, str] = {}  # by choice index: how it ended, as the client sees it
        self.error: str | None = None  # an engine error ended the response
        self.error_status = 503  # its status, had no token gone out: 500 when the output path failed
        self.abort_reason: str | None = None  # why the server aborted it (``--request-timeout``)
        self.open = request.n  # choices not ended yet
        self.buffer: list[bytes] = []
        self.backlogged = False  # a choice has text merged for the next write (``Choice.unsent_*``)
        self.closed = False  # nothing will be added to ``buffer`` any more
        self.done = asyncio.Event()
        self._waiter: asyncio.Future[None] | None = None
        self.write_started = 0.0  # monotonic start of a write still in progress; 0 when none
        self.last_write = 0.0  # monotonic end of the last write (0: the headers are not out yet)
        self.produced = False  # a token was rendered (a stream with none may still get a plain error)
        self.writer: asyncio.Task[Any] | None = None  # the task writing it (the stall watchdog cancels it)
        self.stalled = False  # dropped by the stall watchdog
        self.gone = False  # the client hung up

    # ----------------------------------------------------------------- the writer's side

    def put(self, data: bytes) -> None:
        self.buffer.append(data)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def hang_up(self) -> None:
        """The client went away: nothing more is written."""
        self.gone = True
        self.done.set()
        self._wake()

    async def take(self) -> bytes | None:
        """Everything buffered, as one piece, once there is any; None once the response is
        complete and all of it was taken, or the client is gone."""
        while not self.gone:
            if self.buffer or self.backlogged:
                break
            if self.closed:
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        else:
            return None
        if self.backlogged:
            self._render_backlog()
        buffer, self.buffer = self.buffer, []
        return buffer[0] if len(buffer) == 1 else b"".join(buffer)

    def _render_backlog(self) -> None:
        self.backlogged = False
        for choice in self.choices:
            if choice.unsent_ids:
                self.buffer.append(self.renderer.chunk(choice, "".join(choice.unsent_text), choice.unsent_ids,
                                                       [None] * len(choice.unsent_ids), None, None,
                                                       "".join(choice.unsent_reasoning)))
                choice.unsent_text, choice.unsent_ids, choice.unsent_reasoning = [], [], []

    # ----------------------------------------------------------------- the processor's side

    def emit(self, choice: Choice, text: str, token_id: int, logprob: Logprob) -> None:
        """One token of ``choice`` that does not end it."""
        self.produced = True
        reasoning = ""
        if choice.reasoning is not None:
            reasoning, text = choice.split(text, [token_id])
        if not self.streaming:
            choice.parts.append(text)
            if reasoning:
                choice.thought.append(reasoning)
            choice.token_ids.append(token_id)
            choice.logprobs.append(logprob)
            return
        renderer = self.renderer
        if not renderer.plain:
            self.put(renderer.chunk(choice, text, [token_id], [logprob], None, None, reasoning))
        elif choice.unsent_ids or len(self.buffer) >= COALESCE_AFTER:
            choice.unsent_text.append(text)
            if reasoning:
                choice.unsent_reasoning.append(reasoning)
            choice.unsent_ids.append(token_id)
            self.backlogged = True
            self._wake()  # the writer renders the merged chunk when it next writes
        elif choice.reasoning is None:
            self.put(renderer.token(choice, text))
        else:  # a token held back (part of a tag) makes no chunk: its text comes with a later one
            if reasoning:
                self.put(renderer.token(choice, reasoning, reasoning=True))
            if text:
                self.put(renderer.token(choice, text))

    def end(self, choice: Choice, text: str, token_ids: list[int], logprobs: list[Logprob], reason: str) -> None:
        """``choice`` ends with ``text`` (and the tokens it came from, if any)."""
        self.produced = True
        choice.ended = True
        self.reasons[choice.index] = reason
        self.open -= 1
        abort_reason = self.abort_reason if reason == FinishReason.ABORT else None
        reasoning = ""
        if choice.reasoning is not None:
            reasoning, text = choice.split(text, token_ids, last=True)
        if self.streaming:
            if choice.unsent_ids:
                text, token_ids = "".join(choice.unsent_text) + text, choice.unsent_ids + token_ids
                reasoning = "".join(choice.unsent_reasoning) + reasoning
                unsent: list[Logprob] = [None] * len(choice.unsent_ids)
                logprobs = unsent + logprobs
                choice.unsent_text, choice.unsent_ids, choice.unsent_reasoning = [], [], []
            self.put(self.renderer.chunk(choice, text, token_ids, logprobs, reason, abort_reason, reasoning))
        else:
            choice.parts.append(text)
            if reasoning:
                choice.thought.append(reasoning)
            choice.token_ids += token_ids
            choice.logprobs += logprobs
        if self.open == 0:
            self._complete()

    def fail(self, message: str, internal: bool = False) -> None:
        """The response ends with an error (its other choices are given up): an engine error, or
        (``internal``) the output path itself failed on it, and then nothing more goes through its
        renderer or its merged text (either may be what raised)."""
        if self.closed or self.error is not None:
            return
        self.error = message
        if internal:
            self.error_status = 500
        for choice in self.choices:
            if not choice.ended:
                choice.ended = True
                self.reasons[choice.index] = FinishReason.ERROR
        self.open = 0
        if self.streaming:
            if internal:
                for choice in self.choices:
                    choice.unsent_text, choice.unsent_ids, choice.unsent_reasoning = [], [], []
                self.backlogged = False
            elif self.backlogged:
                self._render_backlog()  # text merged for the next write goes before the error
            self.put(self.renderer.error(message, "internal_error" if internal else "engine_error"))
        self._complete(usage=not internal)

    def _complete(self, usage: bool = True) -> None:
        if self.streaming:
            if self.terminal:
                if usage and self.include_usage:
                    self.put(self.renderer.usage_chunk(self.usage()))
                if self.renderer.stream_end:
                    self.put(self.renderer.stream_end)
            self.closed = True
        self.done.set()

    # ----------------------------------------------------------------- reading the result

    def usage(self) -> dict[str, object]:
        """One prompt, however many choices: its tokens count once, completions add up (and
        their think blocks' tokens, when the answers are split)."""
        reasoning = None
        if self.choices[0].reasoning is not None:
            reasoning = sum(c.reasoning.reasoning_tokens for c in self.choices if c.reasoning is not None)
        return usage_dict(len(self.request.prompt_token_ids), sum(c.completion_tokens for c in self.choices),
                          self.choices[0].cached_tokens, reasoning)

    def answers(self) -> list[dict[str, Any]]:
        """Each choice's whole non-streaming answer."""
        return [self.renderer.answer(c, "".join(c.parts), c.token_ids, c.logprobs, self.reasons[c.index],
                                     self.abort_reason, "".join(c.thought) if c.reasoning is not None else None)
                for c in self.choices]

    def body(self) -> dict[str, Any]:
        """The whole non-streaming answer."""
        return self.renderer.body(self.answers(), self.usage(), self.prompt_logprobs)


class RequestHandle:
    """The one owner of a response's requests in the engine: entered before anything is sent to
    the client, left however the response ends; leaving it (once, whatever the number of
    calls) forgets the response's choices and aborts those the scheduler may still run."""

    __slots__ = ("_release", "_released", "output")

    def __init__(self, output: Output, release: Callable[[Output], Awaitable[None]]) -> None:
        self.output = output
        self._release = release
        self._released = False

    def rebind(self, release: Callable[[Output], Awaitable[None]]) -> None:
        """The response moved to another engine (failover): leaving it releases it there."""
        self._release = release

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._released:
            self._released = True
            await self._release(self.output)


class OutputProcessor:
    """The live choices by rid, and the loop that turns each ``TokenBatch`` into their output.

    ``abort`` is called with the rid of a choice a stop string ended, so the scheduler stops
    computing it."""

    def __init__(self, abort: Callable[[int], None], metrics: Metrics | None = None) -> None:
        self.choices: dict[int, Choice] = {}
        self.rid_by_id: dict[str, int] = {}  # live requests' public ids, for the admin API
        self.num_waiting_first_token = 0
        self._abort = abort
        self.metrics = metrics

    def __len__(self) -> int:
        return len(self.choices)

    def add(self, output: Output) -> None:
        for choice in output.choices:
            self.choices[choice.rid] = choice
            self.rid_by_id[choice.request_id] = choice.rid
        self.num_waiting_first_token += len(output.choices)

    def release(self, output: Output) -> list[int]:
        """The response is done with its choices: forget them. Returns the rids the scheduler
        may still be computing (they must be aborted there)."""
        live = []
        for choice in output.choices:
            self._drop(choice)
            if not choice.abort_sent and choice.index not in output.finishes:
                choice.abort_sent = True
                live.append(choice.rid)
        return live

    def move(self, choice: Choice, to: OutputProcessor, rid: int) -> None:
        """``choice`` goes on under ``rid`` in ``to`` (another engine's): its tokens here are
        void from now on, and its text continues with what arrives there."""
        del self.choices[choice.rid]
        self.rid_by_id.pop(choice.request_id, None)
        if not choice.arrivals:
            self.num_waiting_first_token -= 1
            to.num_waiting_first_token += 1
        choice.rid = rid
        to.choices[rid] = choice
        to.rid_by_id[choice.request_id] = rid

    def _drop(self, choice: Choice) -> None:
        """``choice`` leaves the live set (once): its tokens are void from now on."""
        if self.choices.pop(choice.rid, None) is None:
            return
        self.rid_by_id.pop(choice.request_id, None)
        if not choice.arrivals:
            self.num_waiting_first_token -= 1
        if self.metrics is not None:
            self._record(choice)

    def process(self, batch: TokenBatch) -> None:
        choices = self.choices
        now = time.monotonic()
        finishes = {f.rid: f for f in batch.finished} if batch.finished else None
        for rid, cached in batch.started:
            c = choices.get(rid)
            if c is not None:
                c.cached_tokens = cached
        logprobs = unpack_logprobs(batch.logprobs) if len(batch.logprobs) > 1 else None
        if len(batch.prompt_logprobs) > 1:  # they come with a request's first token, before it
            for rid, entries in unpack_prompt_logprobs(batch.prompt_logprobs).items():
                c = choices.get(rid)
                if c is None or c.output.prompt_logprobs is not None:
                    continue
                if len(entries) == len(c.output.request.prompt_token_ids) - 1:
                    c.output.prompt_logprobs = entries
                else:  # (an engine bug) the response goes on, its prompt unscored
                    log.error("rid %d: %d prompt logprobs for a prompt of %d tokens; not shown", rid, len(entries),
                              len(c.output.request.prompt_token_ids))
        embedded = 0  # embedding requests' tokens here: not generated text (the metrics' tokens/s)
        if len(batch.embeddings) > 1:  # an embedding request's vector comes with its one token
            for rid, vector in unpack_embeddings(batch.embeddings).items():
                c = choices.get(rid)
                if c is not None:
                    c.output.embedding = vector
                    embedded += 1
        # A batch may carry several steps of a request (the scheduler merges the steps it gets
        # at once): a finish goes with the request's last token in it.
        last = {rid: i for i, rid in enumerate(batch.rids) if rid in finishes} if finishes else None
        counted = 0
        for i, (rid, token) in enumerate(zip(batch.rids, batch.token_ids, strict=True)):
            c = choices.get(rid)
            if c is None:
                continue  # ended here already (a stop string, a client gone): its tokens are void
            counted += 1
            if not c.arrivals:
                self.num_waiting_first_token -= 1
            c.arrivals.append(now)
            c.completion_tokens += 1
            c.generated.append(token)
            finish = finishes.pop(rid) if finishes is not None and last is not None and last.get(rid) == i else None
            entries = logprobs.get(rid) if logprobs else None
            lp = entries.pop(0) if entries else None  # (a row's entries come in its tokens' order)
            # The fault boundary: whatever one choice's text does to its detokenizer, stop
            # strings, tool parser or renderer ends that response alone (``_fault``); the rest of
            # the batch goes on. (A ``try`` costs nothing until something raises.)
            try:
                if finish is not None and finish.reason == FinishReason.STOP and token in c.silent_ids:
                    text = ""
                else:
                    text = c.detok.push(token)
                    if not text and token in c.output.hidden_tags:
                        text = c.output.hidden_tags[token]
                stops = c.stops
                if stops is not None:
                    text, hit = stops.feed(text)
                    if hit:
                        if finish is not None:
                            c.output.finishes[c.index] = finish
                        else:  # still running in the scheduler: stop it there
                            c.abort_sent = True
                            self._abort(rid)
                        self._end(c, text, [token], [lp], FinishReason.STOP)
                        continue
                if finish is not None:
                    self._finish(c, finish, text, [token], [lp])
                else:
                    c.output.emit(c, text, token, lp)
            except Exception as e:
                if finish is not None:
                    c.output.finishes[c.index] = finish
                self._fault(c, e)
        if finishes:
            for finish in finishes.values():
                c = choices.get(finish.rid)
                if c is not None:
                    try:
                        self._finish(c, finish, "", [], [])
                    except Exception as e:
                        self._fault(c, e)
        if counted > embedded and self.metrics is not None:
            self.metrics.count_tokens(counted - embedded)

    def _finish(self, c: Choice, finish: Finish, text: str, token_ids: list[int], logprobs: list[Logprob]) -> None:
        """The scheduler's finish of ``c``, with the token that ended it, if any."""
        output = c.output
        output.finishes[c.index] = finish
        c.cached_tokens = finish.cached_tokens
        if finish.reason == FinishReason.ERROR:
            self._fail(output, finish.message or "engine error")
            return
        if c.stops is not None:
            text += c.stops.flush()
        self._end(c, text, token_ids, logprobs, finish.reason)

    def _end(self, c: Choice, text: str, token_ids: list[int], logprobs: list[Logprob], reason: str) -> None:
        c.output.end(c, text, token_ids, logprobs, reason)
        self._drop(c)

    def _fail(self, output: Output, message: str) -> None:
        output.fail(message)
        for choice in output.choices:
            self._drop(choice)

    def _fault(self, c: Choice, error: Exception) -> None:
        """Rendering ``c``'s output raised (a bug, or model text that some part of the output
        path could not take): its response ends with an error chunk and its choices still
        running are aborted in the scheduler, so their blocks come back. Nothing else in the
        batch is touched."""
        output = c.output
        log.exception("request %s: its output could not be rendered (%s: %s); ending it with an error, the "
                      "other requests go on", c.request_id, type(error).__name__, error, exc_info=error)
        output.fail(f"the server could not render this response's output ({type(error).__name__}); "
                    "the request was stopped", internal=True)
        for rid in self.release(output):
            self._abort(rid)

    def fail_all(self, message: str) -> list[int]:
        """Every live response ends with an engine error; returns the rids to abort."""
        outputs = {id(c.output): c.output for c in self.choices.values()}
        rids = []
        for output in outputs.values():
            self._fail(output, message)
            rids += self.release(output)
        return rids

    def _record(self, c: Choice) -> None:
        assert self.metrics is not None
        output = c.output
        request = output.request
        finish = output.finishes.get(c.index)
        arrivals = c.arrivals
        self.metrics.record(
            request_id=c.request_id,
            endpoint=output.renderer.endpoint,
            user=request.user,
            priority=request.priority,
            prompt_tokens=len(request.prompt_token_ids),
            completion_tokens=c.completion_tokens if output.embedding is None else 0,
            cached_tokens=c.cached_tokens,
            finish_reason=output.reasons.get(c.index, FinishReason.ABORT),
            ttft=arrivals[0] - output.started if arrivals else None,
            itls=[b - a for a, b in itertools.pairwise(arrivals)],
            e2e=time.monotonic() - output.started,
            queue_s=finish.queue_s if finish is not None else None,
            preemptions=finish.preemptions if finish is not None else None,
        )
