"""Greedy answers served against a reference worker's, token by token, for the serve tests whose
server computes differently from the reference (quantized weights, a bfloat16 KV cache): at each
token the reference, fed the same text, picks the served token or one within a near-tie of it."""

from __future__ import annotations

import httpx
import torch
from tokenizers import Tokenizer

from worker.attention import SdpaBackend
from worker.engine import Worker


def chat_prompt(worker: Worker, question: str) -> list[int]:
    """SmolLM2's chat template around one user turn, as token ids."""
    text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    return Tokenizer.from_str(worker.info.tokenizer_json).encode(text).ids


async def greedy_ids(client: httpx.AsyncClient, url: str, prompt: list[int] | str, new_tokens: int) -> list[int]:
    """Exactly ``new_tokens`` greedy tokens (EOS held back) from ``/v1/completions``."""
    r = await client.post(f"{url}/v1/completions", json={
        "prompt": prompt, "temperature": 0, "max_tokens": new_tokens, "min_tokens": new_tokens,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return list(r.json()["choices"][0]["token_ids"])


def tipped_near_ties(reference: Worker, prompt: list[int], answer: list[int], near_tie: float, label: str) -> int:
    """How many of ``answer``'s tokens differ from the reference's greedy pick; each must trail it
    by less than ``near_tie`` logits. The reference's cache must hold its first 40 blocks."""
    ids = prompt + answer
    meta = SdpaBackend(reference.device).build(reference.runner.cache, [list(range(40))], [0], [len(ids)],
                                               list(range(len(ids))))
    with torch.inference_mode():
        logits = reference.runner.model(torch.tensor(ids), meta)[len(prompt) - 1 : -1]
        logits[:, reference.info.eos_token_ids] = -torch.inf  # min_tokens held EOS back on the server
    best = logits.argmax(-1).tolist()
    tipped = 0
    for i in (i for i in range(len(answer)) if best[i] != answer[i]):
        gap = (logits[i, best[i]] - logits[i, answer[i]]).item()
        assert gap < near_tie, f"{label}: token {i} is {answer[i]}, the reference's {best[i]} leads by {gap:.3f}"
        tipped += 1
    return tipped
