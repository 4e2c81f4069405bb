"""What ``sluice bench`` sends: prompts of given token lengths, output lengths, priorities, arrival times.

Everything here is a pure function of the flags and the seed (no I/O; ``draw_seed`` aside), so a
run can be repeated exactly and a test can compute the very schedule the runner follows. Each
purpose draws from its own seeded stream (``Random(f"{seed}:purpose")``), so changing, say,
``--request-rate`` leaves the prompts of a run as they were.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Common short English words. Byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, SmolLM) make one
# token of most of them after a space; others differ, which is why the runner first measures the
# server's tokens per word (``fit_shape``) instead of trusting this.
_WORD_LIST = (
    "the of and to in is it that was for on are with as be at by this have from or one had not but what "
    "all were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first "
    "been its who now people my made over did down only way find use may water long little very after "
    "words called just where most know"
)
WORDS = tuple(_WORD_LIST.split())


@dataclass(frozen=True)
class Length:
    """A token count: fixed (``lo == hi``) or drawn uniformly from ``lo..hi`` inclusive."""

    lo: int
    hi: int

    def draw(self, rng: random.Random) -> int:
        return self.lo if self.lo == self.hi else rng.randint(self.lo, self.hi)


def parse_length(text: str) -> Length:
    """``128`` or ``32:512``."""
    lo_s, sep, hi_s = text.partition(":")
    try:
        lo = int(lo_s)
        hi = int(hi_s) if sep else lo
    except ValueError:
        raise ValueError(f"{text!r}: expected N or LO:HI (token counts)") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{text!r}: need 1 <= LO <= HI")
    return Length(lo, hi)


def parse_priority_mix(text: str) -> list[tuple[int, float]]:
    """``0:0.2,5:0.8`` -> [(0, 0.2), (5, 0.8)]: the fraction of requests sent with each priority."""
    mix: list[tuple[int, float]] = []
    for part in text.split(","):
        prio_s, sep, frac_s = part.partition(":")
        try:
            prio, frac = int(prio_s), float(frac_s)
        except ValueError:
            raise ValueError(f"{part!r}: expected PRIORITY:FRACTION") from None
        if not sep or not 0 < frac <= 1:
            raise ValueError(f"{part!r}: expected PRIORITY:FRACTION with 0 < FRACTION <= 1")
        mix.append((prio, frac))
    if len({p for p, _ in mix}) != len(mix):
        raise ValueError(f"{text!r}: a priority appears twice")
    if abs(sum(f for _, f in mix) - 1.0) > 1e-6:
        raise ValueError(f"{text!r}: the fractions must add up to 1")
    return mix


def parse_token_id_range(text: str) -> tuple[int, int]:
    """``LO:HI`` -> ids drawn from ``range(LO, HI)``."""
    lo_s, _, hi_s = text.partition(":")
    try:
        lo, hi = int(lo_s), int(hi_s)
    except ValueError:
        raise ValueError(f"{text!r}: expected LO:HI (token ids)") from None
    if lo < 0 or hi <= lo:
        raise ValueError(f"{text!r}: need 0 <= LO < HI")
    return lo, hi


@dataclass(frozen=True)
class PromptShape:
    """How the server's tokenizer counts generated text: tokens ~ overhead + per_word x words
    (overhead: BOS, a chat template). Measured by the runner with two probe prompts."""

    per_word: float = 1.0
    overhead: float = 0.0

    def words_for(self, tokens: float) -> int:
        return max(1, round(tokens / self.per_word))


def fit_shape(points: list[tuple[int, int]]) -> PromptShape:
    """The line through two (words, prompt tokens) probes (``calibration_prompts``). Degenerate
    answers (a server that counts no difference) fall back to one token per word."""
    (w1, t1), (w2, t2) = points
    per_word = (t2 - t1) / (w2 - w1)
    if not per_word > 0:
        return PromptShape()
    return PromptShape(per_word, max(0.0, t1 - per_word * w1))


def calibration_prompts() -> list[tuple[int, str]]:
    """Two probes, (word count, text): every word of WORDS once, then twice. Their difference in
    prompt tokens is WORDS once with a space before each word, so the slope is exactly the mean
    tokens per word that random prompts draw from, and the rest (BOS, a chat template, the first
    word's lack of a space) is the overhead."""
    once = " ".join(WORDS)
    return [(len(WORDS), once), (2 * len(WORDS), f"{once} {once}")]

# Token-id prompts: ids above the special tokens most vocabularies put first (SmolLM2 0..16, Llama
# 0..2) and below 512, so they exist in any vocabulary, Sluice's 512-id tiny model's included.
DEFAULT_TOKEN_IDS = (100, 500)


def draw_seed() -> int:
    """A seed for a run given no ``--seed``: from the OS's entropy, so that two runs send different
    prompts (the same prompts again would be answered from a server's prefix cache)."""
    return random.SystemRandom().randrange(1 << 31)


def random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. ``input_len`` is the intended prompt length (0: unknown, a dataset's
    text); the report uses the count the server returns in ``usage``. ``priority`` None: no
    ``priority`` field is sent. ``label`` names the request's class in a scenario's workload
    ("long", "short"): the report then has a column per class, as it has per priority.
    ``extra``: more body fields (a scenario's ``structured_outputs``); a request that sets them
    is not sent ``ignore_eos`` (a constrained output ends where its grammar does)."""

    prompt: str | list[int]
    input_len: int
    output_len: int
    priority: int | None
    label: str | None = None
    extra: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class DatasetRow:
    prompt: str | list[int]
    output_len: int


def load_dataset(path: Path) -> list[DatasetRow]:
    """JSONL, one ``{"prompt": str | [int], "output_len": int}`` per line (other keys ignored)."""
    rows: list[DatasetRow] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt, output_len = item["prompt"], int(item["output_len"])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: expected {{\"prompt\": ..., \"output_len\": N}} ({e})") from None
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
                raise ValueError(f"{path}:{lineno}: prompt must be a string or a list of token ids")
            if output_len < 1:
                raise ValueError(f"{path}:{lineno}: output_len must be >= 1")
            rows.append(DatasetRow(prompt, output_len))
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def assign_priorities(n: int, mix: list[tuple[int, float]] | None, rng: random.Random) -> list[int | None]:
    """Exactly round(fraction x n) requests per class (largest remainder, so they add up to n),
    in a seeded random order: a 0.2/0.8 mix of 10 requests is 2 and 8, not 'about'."""
    if not mix:
        return [None] * n
    exact = [f * n for _, f in mix]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(mix)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    out: list[int | None] = [p for (p, _), c in zip(mix, counts, strict=True) for _ in range(c)]
    rng.shuffle(out)
    return out


def build_requests(
    n: int,
    *,
    seed: int,
    input_len: Length,
    output_len: Length,
    shape: PromptShape = PromptShape(),
    shared_prefix: int = 0,
    token_ids: tuple[int, int] | None = None,
    priority_mix: list[tuple[int, float]] | None = None,
    dataset: list[DatasetRow] | None = None,
    stream: str = "run",
    label: str | None = None,
) -> list[RequestSpec]:
    """``n`` requests. Text prompts are random words, about ``input_len`` tokens by ``shape``;
    with ``token_ids`` they are exactly that many ids from ``range(*token_ids)``. With
    ``shared_prefix`` every prompt starts with the same prefix of that many tokens (text: words
    by ``shape``), the rest drawn per request. ``dataset`` rows (shuffled, cycled when
    ``n`` exceeds them) replace the generated prompts and output lengths. ``stream`` names the
    random stream, so warm-up requests differ from the measured ones. ``label``: every request's
    class (``RequestSpec.label``)."""
    rng = random.Random(f"{seed}:{stream}:prompts")
    prefix_rng = random.Random(f"{seed}:prefix")  # the same prefix for warm-up and run
    priorities = assign_priorities(n, priority_mix, random.Random(f"{seed}:{stream}:priorities"))
    prefix_text = random_words(prefix_rng, shape.words_for(shared_prefix)) if shared_prefix else ""
    id_range = token_ids or DEFAULT_TOKEN_IDS
    prefix_ids = [prefix_rng.randrange(*id_range) for _ in range(shared_prefix)]
    rows = list(dataset or [])
    rng.shuffle(rows)
    specs: list[RequestSpec] = []
    for i in range(n):
        prompt: str | list[int]
        if rows:
            row = rows[i % len(rows)]
            out_len = row.output_len
            if isinstance(row.prompt, list):
                prompt = prefix_ids + row.prompt
                in_len = len(prompt)
            else:  # its length is the server's to say
                prompt = f"{prefix_text} {row.prompt}" if prefix_text else row.prompt
                in_len = 0
        else:
            in_len, out_len = input_len.draw(rng), output_len.draw(rng)
            if token_ids:
                prompt = prefix_ids + [rng.randrange(*token_ids) for _ in range(in_len - shared_prefix)]
            else:
                # The overhead (BOS, template) is part of the server's count: leave room for it.
                words = shape.words_for(max(1.0, in_len - shape.overhead - shared_prefix))
                body = random_words(rng, words)
                prompt = f"{prefix_text} {body}" if prefix_text else body
        specs.append(RequestSpec(prompt, in_len, out_len, priorities[i], label))
    return specs


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``n`` requests at ``rate`` per second: gaps from a gamma
    distribution of shape ``burstiness`` and mean 1/rate (1 = exponential, a Poisson process;
    < 1 burstier, > 1 more even). As ``vllm bench serve`` does, the times are then scaled so the
    last one falls at exactly n / rate: runs with different seeds offer the same load. ``inf``:
    all at once."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}:arrivals")
    times: list[float] = []
    t = 0.0
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    scale = (n / rate) / times[-1] if times and times[-1] > 0 else 1.0
    return [x * scale for x in times]
