"""The model's own sampling defaults, as vLLM applies them by default: what its maker recommends
replaces OpenAI's defaults (temperature 1, no top-p) for a request that does not say.

A Hugging Face directory's ``generation_config.json`` gives them (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, where present). A GGUF file carries none, so the
built-in SmolLM2 takes its model card's: it generates with temperature 0.2 and top-p 0.9, and
at temperature 1 a 135M model rambles (758 tokens of word salad in the first user's report).
``--generation-config none`` keeps OpenAI's defaults whatever the model says.
"""

from __future__ import annotations

import json
from pathlib import Path

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
SMOLLM2_CARD = ({"temperature": 0.2, "top_p": 0.9}, "the SmolLM2-135M-Instruct model card")


def sampling_defaults(model: str, source: Path, mode: str) -> tuple[dict[str, float], str]:
    """(the defaults, where they come from) for ``--model model`` loaded from ``source``;
    nothing with ``mode`` "none", or when the model says nothing."""
    if mode == "none":
        return {}, ""
    if model == "smollm2":
        return dict(SMOLLM2_CARD[0]), SMOLLM2_CARD[1]
    path = source / "generation_config.json"
    if not path.is_file():
        return {}, ""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}, ""  # the loader reads this file too and says what is wrong with it
    found = {k: float(raw[k]) for k in FIELDS if isinstance(raw.get(k), int | float) and not isinstance(raw[k], bool)}
    return found, str(path) if found else ""
