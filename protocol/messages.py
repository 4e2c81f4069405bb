"""Every message that crosses a process boundary in Sluice.

Three links, each a tagged union decoded by one typed decoder:

* frontend -> scheduler: ``FrontendMessage`` (requests, aborts, controls, pings)
* scheduler -> frontend: ``SchedulerMessage`` (tokens and finishes, readiness, replies)
* scheduler -> worker:   ``WorkerCommand`` (step plans with their block copies, shutdown)
* worker -> scheduler:   ``WorkerMessage`` (sampled tokens per step, readiness, errors)

Every message is ``array_like`` (msgspec cannot mix the two encodings in one union, and the
hot-path ones want it anyway): field order *is* the wire format, so new fields are only ever
appended. Requests are named on the hot path by ``rid``, an integer the frontend assigns: its
incarnation's random epoch in the high bits (``rid_epoch``), a counter in the low ones, so rids
of two frontends, or of one frontend before and after a restart, never meet. The string id users
see travels once, in ``AddRequest``.

Structs here carry data, not user-input validation: the frontend's API layer validates what
clients send before anything becomes one of these.
"""

from __future__ import annotations

import secrets

import msgspec

RID_COUNTER_BITS = 32
# 21 + 32 bits: rids stay exact in JSON readers that use doubles (2**53), such as browsers.
EPOCH_BITS = 21


def new_epoch() -> int:
    """A random incarnation id (a frontend's rid prefix, a scheduler's identity): never 0."""
    return secrets.randbits(EPOCH_BITS) or 1

# --------------------------------------------------------------------------------------------
# Shared value types


class SamplingParams(msgspec.Struct, array_like=True, frozen=True):
    """How one request samples and when it stops on token ids (stop *strings* are the frontend's)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_tokens: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs to return per token; None = off
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one; 0 = off
    repetition_penalty: float = 1.0  # on tokens of the prompt and the output; 1 = off
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: list[tuple[int, float]] = []  # (token id, bias added to its logit)
    # Structured output: an llguidance grammar (its JSON text: a JSON schema, regex, choice or
    # Lark grammar compiled by the frontend, which validated it). None: unconstrained.
    grammar: str | None = None
    # vLLM's prompt_logprobs: the logprob of every prompt token after the first, and this many
    # alternatives each (0: none); None = off. Only the choice that computes the prompt carries
    # it, and only until its first output token (``scheduler/request.py``).
    prompt_logprobs: int | None = None
    # An embedding request (``/v1/embeddings``): its prompt's final hidden states pooled, "last"
    # (the last token's) or "mean", instead of any output; it ends after its prompt (max_tokens 1).
    pooling: str | None = None

    @property
    def every_position(self) -> bool:
        """Every prompt position must be computed by this request itself (no prefix cache, no
        swap): it scores them (prompt logprobs) or averages them (mean pooling)."""
        return self.prompt_logprobs is not None or self.pooling == "mean"

    @property
    def reads_history(self) -> bool:
        """Sampling depends on the request's own earlier tokens (the penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class FinishReason:
    """Values of ``Finish.reason``; plain strings so they read the same on the wire and in JSON."""

    STOP = "stop"  # EOS, a stop token id, or (decided in the frontend) a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client disconnect, admin abort
    ERROR = "error"  # the engine could not run it (worker crash, impossible request)


class Finish(msgspec.Struct, array_like=True, frozen=True):
    rid: int
    reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    message: str = ""  # why, for reason == "error"
    queue_s: float = 0.0  # arrival to first scheduled
    preemptions: int = 0


# One sampled token's logprobs: (its logprob, top-k token ids, their logprobs); None when the
# request did not ask.
Logprob = tuple[float, list[int], list[float]] | None

# A step's logprobs travel as msgpack bytes the scheduler never decodes: a list of (rid, entry)
# pairs for the rows that asked for them, packed by the worker and read by the frontend. A step
# without any is msgpack's nil.
NO_LOGPROBS = msgspec.Raw(b"\xc0")
_logprob_pairs = msgspec.msgpack.Decoder(list[tuple[int, tuple[float, list[int], list[float]]]])


def pack_logprobs(pairs: list[tuple[int, tuple[float, list[int], list[float]]]]) -> msgspec.Raw:
    """``(rid, logprob entry)`` pairs as the opaque field of ``StepTokens`` and ``TokenBatch``."""
    return msgspec.Raw(msgspec.msgpack.encode(pairs)) if pairs else NO_LOGPROBS


def unpack_logprobs(raw: msgspec.Raw) -> dict[int, list[tuple[float, list[int], list[float]]]]:
    """The entries ``pack_logprobs`` packed, by rid, each rid's in the order of its tokens (a
    step of speculative decoding gives a row several); empty for ``NO_LOGPROBS``."""
    by_rid: dict[int, list[tuple[float, list[int], list[float]]]] = {}
    for rid, entry in _logprob_pairs.decode(raw) if len(raw) > 1 else ():
        by_rid.setdefault(rid, []).append(entry)
    return by_rid


# A request's prompt logprobs travel the same way, whole, with its first output token: a list of
# (rid, entries), entry i for prompt token i + 1 (the first token has none): its logprob, its rank
# in the vocabulary (1: the most likely), then the most likely ids and their logprobs.
PromptLogprob = tuple[float, int, list[int], list[float]]
_prompt_logprob_pairs = msgspec.msgpack.Decoder(list[tuple[int, list[PromptLogprob]]])


def pack_prompt_logprobs(pairs: list[tuple[int, list[PromptLogprob]]]) -> msgspec.Raw:
    """``(rid, prompt logprob entries)`` pairs as the opaque field of ``StepTokens`` and ``TokenBatch``."""
    return msgspec.Raw(msgspec.msgpack.encode(pairs)) if pairs else NO_LOGPROBS


def unpack_prompt_logprobs(raw: msgspec.Raw) -> dict[int, list[PromptLogprob]]:
    """The entries ``pack_prompt_logprobs`` packed, by rid; empty for ``NO_LOGPROBS``."""
    return dict(_prompt_logprob_pairs.decode(raw)) if len(raw) > 1 else {}


# An embedding request's pooled vector travels the same way, with its one output: (rid, the
# L2-normalised vector as little-endian float32 bytes) pairs.
_embedding_pairs = msgspec.msgpack.Decoder(list[tuple[int, bytes]])


def pack_embeddings(pairs: list[tuple[int, bytes]]) -> msgspec.Raw:
    """``(rid, float32 bytes)`` pairs as the opaque field of ``StepTokens`` and ``TokenBatch``."""
    return msgspec.Raw(msgspec.msgpack.encode(pairs)) if pairs else NO_LOGPROBS


def unpack_embeddings(raw: msgspec.Raw) -> dict[int, bytes]:
    """The vectors ``pack_embeddings`` packed, by rid; empty for ``NO_LOGPROBS``."""
    return dict(_embedding_pairs.decode(raw)) if len(raw) > 1 else {}

# --------------------------------------------------------------------------------------------
# frontend -> scheduler


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    rid: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    user: str = ""
    arrival_time: float = 0.0
    # n > 1 choices of one prompt: the scheduler makes requests ``rid .. rid + n - 1`` (ids
    # ``request_id``, ``request_id-1``, ...; seeds ``seed + i``), so the prompt crosses once.
    # The later ones wait until the first has computed the prompt, then start on its KV blocks
    # through the prefix cache (shared, copied at the first divergent one).
    n: int = 1
    # A request continued from another engine (the frontend's failover): the tokens it has
    # generated there. They are computed with the prompt, and count as its output (max_tokens,
    # stop rules, penalties and its grammar's state see them so); n is 1.
    output_token_ids: list[int] = []


class AbortRequest(msgspec.Struct, tag=True, array_like=True):
    rid: int


class SetPriority(msgspec.Struct, tag=True, array_like=True):
    """Change a live request's priority at once (the next read and the next plan see it);
    ``cut_in`` schedules it at the next step. With ``query_id``, the scheduler answers with a
    ``QueryReply`` saying whether the request was there to change (this goes for the pause and
    resume messages too)."""

    rid: int
    priority: int
    cut_in: bool = False
    query_id: int = 0  # 0: no answer wanted


class PauseRequest(msgspec.Struct, tag=True, array_like=True):
    rid: int
    query_id: int = 0


class ResumeRequest(msgspec.Struct, tag=True, array_like=True):
    rid: int
    query_id: int = 0


class PauseAll(msgspec.Struct, tag=True, array_like=True):
    pass


class ResumeAll(msgspec.Struct, tag=True, array_like=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag=True, array_like=True):
    pass


class StatsQuery(msgspec.Struct, tag=True, array_like=True):
    """Ask for the scheduler's stats; answered by a ``QueryReply`` with the same ``query_id``."""

    query_id: int = 0


class RequestsQuery(msgspec.Struct, tag=True, array_like=True):
    """Ask for a summary of every live request of the asking frontend (``QueryReply.data``)."""

    query_id: int = 0


class RequestQuery(msgspec.Struct, tag=True, array_like=True):
    """Ask for one live request's summary; ``QueryReply.found`` False if it is not live."""

    rid: int
    query_id: int = 0


Query = StatsQuery | RequestsQuery | RequestQuery


class Ping(msgspec.Struct, tag=True, array_like=True):
    """Sent by the frontend periodically; the scheduler answers with ``Pong``, and also with
    ``EngineReady`` when ``need_model`` is set and the workers are ready. Nothing is ever sent to
    a frontend before its first ping, so the scheduler never blocks on an absent peer.
    """

    sent_at: float
    need_model: bool = False


FrontendMessage = (
    AddRequest
    | AbortRequest
    | SetPriority
    | PauseRequest
    | ResumeRequest
    | PauseAll
    | ResumeAll
    | ResetPrefixCache
    | StatsQuery
    | RequestsQuery
    | RequestQuery
    | Ping
)

# --------------------------------------------------------------------------------------------
# scheduler -> frontend


class TokenBatch(msgspec.Struct, tag=True, array_like=True):
    """New tokens of one worker step, and the requests that ended with it.

    ``rids[i]`` gained ``token_ids[i]``; a request may have several tokens in one batch (several
    steps the scheduler received at once), in order. A request may appear in ``finished``
    without a token (abort, error); with tokens, its finish came with the last of them. ``logprobs``: the step's ``pack_logprobs`` bytes, passed through as the
    worker made them (they may name rids this batch does not carry: those are ignored).
    ``started``: ``(rid, cached prompt tokens)`` of the requests whose first token this is, so
    usage is known even when the frontend ends a request itself (a stop string).

    ``seq`` numbers the batches a scheduler sends to one frontend: 1, 2, 3, ... A gap means a
    batch was lost on the link (ZeroMQ drops messages to a peer that is reconnecting): that
    frontend's streams can no longer be trusted to be whole, so it ends them with an error.
    """

    rids: list[int]
    token_ids: list[int]
    finished: list[Finish] = []
    logprobs: msgspec.Raw = NO_LOGPROBS
    started: list[tuple[int, int]] = []
    seq: int = 0
    prompt_logprobs: msgspec.Raw = NO_LOGPROBS  # ``pack_prompt_logprobs``, passed through like ``logprobs``
    embeddings: msgspec.Raw = NO_LOGPROBS  # ``pack_embeddings``, passed through like ``logprobs``


class ModelInfo(msgspec.Struct, frozen=True):
    """What the frontend must know about the served model; built by the worker after loading."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    tokenizer_json: str  # a serialized ``tokenizers.Tokenizer``
    chat_template: str | None
    add_bos_token: bool
    num_kv_blocks: int
    block_size: int
    # The model's own sampling defaults (its generation config), applied to a request's fields it
    # does not set; and where they come from, for the logs.
    sampling_defaults: dict[str, float] = {}
    sampling_defaults_from: str = ""
    # The named-list form's ``tool_use`` template, which transformers renders when tools are given.
    tool_chat_template: str | None = None
    # The weights' dtype the worker computes in ("float32", "bfloat16", ...): a restarted worker
    # must come back in it, or its recomputed streams change precision.
    dtype: str = ""
    # The GGUF types of the weights kept quantized ("Q4_1, Q8_0"), "" where every weight is in
    # ``dtype``; activations are in ``dtype`` either way.
    quantization: str = ""
    # The KV cache's dtype where it is not ``dtype`` (--kv-cache-dtype bfloat16 under a float32
    # model), else "".
    kv_cache_dtype: str = ""
    # The worker ranks that hold the model between them (tensor parallelism): the scheduler
    # serves once that many have announced themselves.
    tensor_parallel_size: int = 1
    # The width of the model's final hidden states: an embedding's dimensions (/v1/embeddings).
    hidden_size: int = 0


class EngineReady(msgspec.Struct, tag=True, array_like=True):
    model: ModelInfo


class Pong(msgspec.Struct, tag=True, array_like=True):
    """Also carries the scheduler's stats snapshot, so metrics are never older than a ping, and
    its epoch: a new one means a restarted scheduler, which knows none of the earlier requests."""

    sent_at: float
    workers_alive: bool
    ready: bool
    stats: dict[str, float | int | bool | None] | None = None
    scheduler_epoch: int = 0
    unhealthy_reason: str = ""  # why workers are not serving (a failure, a worker being restarted)
    # The ``seq`` of the last TokenBatch sent to this frontend: batches and pongs share one
    # ordered link, so a number past the last batch received means some were lost, even when
    # no batch follows them to show the gap.
    last_batch: int = 0


class QueryReply(msgspec.Struct, tag=True, array_like=True):
    query_id: int
    found: bool
    data: dict[str, object] | list[dict[str, object]] | None = None


class EngineError(msgspec.Struct, tag=True, array_like=True):
    """The engine can no longer serve (a worker died); every live request has been finished."""

    message: str


SchedulerMessage = TokenBatch | EngineReady | Pong | QueryReply | EngineError

# --------------------------------------------------------------------------------------------
# scheduler -> worker


class NewRequest(msgspec.Struct, array_like=True):
    """A request the worker has not seen, or must rebuild: after a recompute preemption
    (``num_computed`` 0), after a prefix-cache hit or a swap-in (``num_computed`` tokens already
    have their KV in the blocks the plan row lists).

    ``token_ids`` is everything known so far: the prompt plus any output already produced.
    """

    rid: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    num_computed: int = 0


class StepPlan(msgspec.Struct, tag=True, array_like=True):
    """One scheduler decision: which requests run and how many tokens each computes.

    For row i: request ``rids[i]`` computes ``num_tokens[i]`` tokens starting at its current
    computed count, after appending ``new_block_ids[i]`` to its block table. A request whose
    computed count then reaches its known token count samples one token. When ``num_steps > 1``
    every request that sampled goes on decoding for ``num_steps - 1`` more steps on the worker,
    with its blocks already reserved by the scheduler; it stops early on its own stop conditions.
    ``forget`` lists rids whose worker state must be dropped before this plan runs.
    """

    plan_id: int
    new_requests: list[NewRequest]
    rids: list[int]
    num_tokens: list[int]
    new_block_ids: list[list[int]]
    num_steps: int = 1
    forget: list[int] = []
    # Block copies the worker performs, in this order, before the plan's first forward pass:
    swap_out: list[tuple[int, int]] = []  # (device block, host block): a swap preemption
    swap_in: list[tuple[int, int]] = []  # (host block, device block): a swapped request resumes
    copy_blocks: list[tuple[int, int]] = []  # (src, dst) device blocks: copy-on-write
    # Planned while the previous plan still ran (async scheduling): each row continues from
    # wherever that plan left it, and a row whose request stopped or was aborted meanwhile is
    # skipped rather than an error. (Not speculative decoding: that is ``num_draft_tokens``.)
    speculative: bool = False
    # Speculative decoding: each decoding row may verify up to this many proposed tokens per
    # step (0: none in this plan), within the blocks it holds; a step then reports every token
    # it accepted and the one sampled after them, and counts the row's drafts as computed only
    # once the row's next step reports (as it counts any step's tokens).
    num_draft_tokens: int = 0


class CancelRows(msgspec.Struct, tag=True, array_like=True):
    """Stop computing ``rids`` in plan ``plan_id`` from the next step boundary the worker reaches
    (an abort or a pause arrived mid-plan). Tokens already sampled are still reported; the
    worker keeps the rows' state unless ``forget`` (an abort: the state is dropped at once)."""

    plan_id: int
    rids: list[int]
    forget: bool = False


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Announce(msgspec.Struct, tag=True, array_like=True):
    """A scheduler that does not know this worker (it restarted, or declared the worker lost):
    drop every request's state and send ``WorkerReady`` again."""


class PrepareGrammar(msgspec.Struct, tag=True, array_like=True):
    """Compile ``grammar`` now, ahead of the plans that will need it (a constrained request
    arrived; it waits in the scheduler meanwhile, vLLM's WAITING_FOR_FSM). Answered with
    ``GrammarReady`` once it is compiled, or failed: either way the request may run."""

    grammar_id: int
    grammar: str


WorkerCommand = StepPlan | CancelRows | Shutdown | Announce | PrepareGrammar

# --------------------------------------------------------------------------------------------
# worker -> scheduler


class StepTokens(msgspec.Struct, tag=True, array_like=True):
    """Tokens sampled in step ``step`` (0-based) of plan ``plan_id``.

    ``last`` marks the final message of the plan: the worker is then free for the next one.
    ``busy_s`` is the worker's compute time for this step (for the device-idle metric).
    """

    plan_id: int
    step: int
    rids: list[int]
    token_ids: list[int]
    last: bool
    busy_s: float = 0.0
    logprobs: msgspec.Raw = NO_LOGPROBS  # ``pack_logprobs`` of the rows that asked
    prompt_logprobs: msgspec.Raw = NO_LOGPROBS  # ``pack_prompt_logprobs``: rows whose first output this is
    embeddings: msgspec.Raw = NO_LOGPROBS  # ``pack_embeddings``: embedding rows, with their one output
    # Speculative decoding, per draft position (0: a step's first proposed token): how many
    # proposals the step verified there, and how many of them were accepted.
    drafted: list[int] = []
    accepted: list[int] = []
    jumped: int = 0  # tokens jump-forward appended (structured output), without a forward pass of their own


class WorkerReady(msgspec.Struct, tag=True, array_like=True):
    rank: int
    model: ModelInfo


class WorkerHeartbeat(msgspec.Struct, tag=True, array_like=True):
    """Sent every 0.5 s by a thread of its own, so it says the process is there, not that it
    works: ``steps`` does that. The scheduler times the plans in flight against it (a count that
    stops moving while a plan runs is a hang, ``scheduler.workers.PlanClock``), and ``pid`` and
    ``process`` let it stop a hung worker that runs on its own machine (``Workers.kill``)."""

    rank: int
    memory: dict[str, float] = {}  # the worker's resident memory (``protocol.process_memory``)
    steps: int = 0  # forward steps its main loop has finished since it started
    pid: int = 0
    process: str = ""  # "<boot id> <pid namespace> <start time>": which process ``pid`` is ("": unknown)


class WorkerFailed(msgspec.Struct, tag=True, array_like=True):
    rank: int
    message: str


class WorkerStopping(msgspec.Struct, tag=True, array_like=True):
    """The worker was told to stop (SIGTERM, or the scheduler's ``Shutdown``) and is leaving: not
    a crash. Its live requests wait for a worker as after a loss, but no restart is counted."""

    rank: int


class GrammarReady(msgspec.Struct, tag=True, array_like=True):
    """The grammars of these ``PrepareGrammar`` ids are compiled: a plan that samples under them
    no longer waits for the compiler."""

    grammar_ids: list[int]


WorkerMessage = StepTokens | WorkerReady | WorkerHeartbeat | WorkerFailed | WorkerStopping | GrammarReady
