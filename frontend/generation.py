"""One request's output as text: detokenization, stop strings and finish, independent of the
API flavour (completions or chat) and of streaming.

``Generation.deltas()`` yields one ``Delta`` per generated token (its text may be empty while a
multi-byte character or a possible stop string is incomplete) and a last one carrying the finish.
Leaving the iterator early (client gone) aborts the request in the scheduler.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator

from frontend.engine_client import EngineClient, RequestStream
from frontend.metrics import Metrics
from frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer, StopStringMatcher
from protocol.messages import AddRequest, FinishReason, Logprob

# Tokens found at once beyond this mean the consumer fell far behind (a stalled client). Set well
# above a window of jitter: a busy event loop can find a few dozen tokens at once, and clients that
# keep up must still see one chunk per token.
COALESCE_AFTER = 256


@dataclasses.dataclass(slots=True)
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list[Logprob]
    finish_reason: str | None = None
    error: str | None = None
    abort_reason: str | None = None  # why the server aborted it (a deadline), for the final chunk


@dataclasses.dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def as_dict(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Generation:
    def __init__(
        self,
        client: EngineClient,
        tokenizer: ModelTokenizer,
        request: AddRequest,
        stop_strings: list[str],
        metrics: Metrics | None = None,
        timeout: float = 0.0,
    ) -> None:
        self._client = client
        self._timeout = timeout  # seconds from arrival; 0 = none (--request-timeout)
        self.abort_reason: str | None = None
        self._metrics = metrics
        self._started = time.monotonic()
        self.finish_reason: str | None = None
        self._request = request
        self._detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self._stops = StopStringMatcher(stop_strings)
        # Tokens that end generation (EOS, stop ids) are not part of the text, as in OpenAI's API.
        sampling = request.sampling
        self._silent_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self._silent_ids.update(tokenizer.info.eos_token_ids)
        self.usage = Usage(len(request.prompt_token_ids), 0, 0)
        self._stream: RequestStream | None = None
        # Per-token logprobs are rendered per token (with their text offsets): never merged.
        self._coalesces = sampling.logprobs is None

    @property
    def request_id(self) -> str:
        return self._request.request_id

    @property
    def rid(self) -> int:
        return self._request.rid

    async def start(self) -> None:
        self._stream = await self._client.add(self._request)

    async def deltas(self) -> AsyncIterator[Delta]:
        stream = self._stream
        if stream is None:
            raise RuntimeError("Generation.start() must be awaited first")
        done = False
        seen = 0
        deadline = self._started + self._timeout if self._timeout > 0 else None
        try:
            while not done:
                if deadline is None:
                    await stream.wait()
                else:
                    try:
                        await asyncio.wait_for(stream.wait(), max(0.0, deadline - time.monotonic()))
                    except TimeoutError:
                        # Out of time: the abort's finish arrives like any other and ends the
                        # stream with finish_reason "abort" and this reason.
                        deadline = None
                        self.abort_reason = f"the request took longer than {self._timeout:g} s (--request-timeout)"
                        await self._client.abort(stream.rid)
                        continue
                new_ids = stream.token_ids[seen:]
                new_logprobs = stream.logprobs[seen:]
                seen += len(new_ids)
                if self._metrics is not None and new_ids:
                    self._metrics.count_tokens(len(new_ids))
                finish = stream.finish
                # A backlog (the consumer fell behind: a slow client) goes out as one delta rather
                # than a write per token; a consumer that keeps up still gets one per token.
                pending = Delta("", [], []) if self._coalesces and len(new_ids) > COALESCE_AFTER else None
                for i, token_id in enumerate(new_ids):
                    final = finish if i == len(new_ids) - 1 else None  # the finish came with this token
                    silent = final is not None and final.reason == FinishReason.STOP and token_id in self._silent_ids
                    text, hit_stop = self._stops.feed("" if silent else self._detok.push(token_id))
                    self.usage.completion_tokens += 1
                    if pending is not None:
                        text = pending.text + text
                        ids, logprobs = [*pending.token_ids, token_id], [*pending.logprobs, new_logprobs[i]]
                    else:
                        ids, logprobs = [token_id], [new_logprobs[i]]
                    if hit_stop:
                        done = True
                        await self._client.abort(stream.rid)
                        self.finish_reason = FinishReason.STOP
                        yield Delta(text, ids, logprobs, FinishReason.STOP)
                        break
                    if final is not None and final.reason != FinishReason.ERROR:
                        # One chunk carries the last token and the finish.
                        done = True
                        self.usage.cached_tokens = final.cached_tokens
                        self.finish_reason = final.reason
                        yield Delta(text + self._stops.flush(), ids, logprobs, final.reason,
                                    abort_reason=self._abort_reason(final.reason))
                        break
                    if pending is not None:
                        pending = Delta(text, ids, logprobs)
                    else:
                        yield Delta(text, ids, logprobs)
                if pending is not None and pending.token_ids and not done:
                    yield pending
                if done or finish is None:
                    continue
                done = True
                self.usage.cached_tokens = finish.cached_tokens
                if finish.reason == FinishReason.ERROR:
                    self.finish_reason = FinishReason.ERROR
                    yield Delta("", [], [], FinishReason.ERROR, error=finish.message or "engine error")
                else:
                    self.finish_reason = finish.reason
                    yield Delta(self._stops.flush(), [], [], finish.reason,
                                abort_reason=self._abort_reason(finish.reason))
        finally:
            if not done:
                # The consumer left early (client disconnected): free the request's blocks now.
                self._client.abort_soon(stream.rid)
            self._client.release(stream.rid)
            self._record(stream)

    def _abort_reason(self, finish_reason: str) -> str | None:
        return self.abort_reason if finish_reason == FinishReason.ABORT else None

    def _record(self, stream: RequestStream) -> None:
        if self._metrics is None:
            return
        arrivals = stream.arrivals[: self.usage.completion_tokens]
        finish = stream.finish
        self._metrics.record(
            request_id=self._request.request_id,
            user=self._request.user,
            priority=self._request.priority,
            prompt_tokens=self.usage.prompt_tokens,
            completion_tokens=self.usage.completion_tokens,
            cached_tokens=self.usage.cached_tokens,
            finish_reason=self.finish_reason or FinishReason.ABORT,
            ttft=arrivals[0] - self._started if arrivals else None,
            itls=[b - a for a, b in itertools.pairwise(arrivals)],
            e2e=time.monotonic() - self._started,
            queue_s=finish.queue_s if finish is not None else None,
            preemptions=finish.preemptions if finish is not None else None,
        )
