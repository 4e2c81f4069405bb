"""What ``--model`` may name, checked where it is typed: the frontend (``sluice serve`` says a
mistake before starting anything) and the worker (``sluice worker`` loads it) agree on one rule.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

BUILTIN_MODELS = ("smollm2", "tiny")
# A Hugging Face Hub repository id: "owner/name", nothing else (a local path has other shapes).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def unknown_model(model: str) -> str | None:
    """Why ``--model`` names nothing that could load, with the closest name it may have meant;
    None if it names a built-in model, an existing path or something shaped like a Hub id."""
    path = Path(model).expanduser()
    if model in BUILTIN_MODELS or path.exists() or (HUB_ID.fullmatch(model) and path.suffix != ".gguf"):
        return None
    what = "no such GGUF file" if path.suffix == ".gguf" else "no such file or directory"
    near = difflib.get_close_matches(model, [*BUILTIN_MODELS, *_siblings(path)], n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (f"--model {model}: {what}{hint} (--model takes 'smollm2', 'tiny', a .gguf file, a Hugging "
            f"Face-format directory or a Hugging Face Hub id)")


def _siblings(path: Path) -> list[str]:
    """The entries beside a mistyped path, spelt as the user would type them (a typo in its
    last part)."""
    parent = path.parent
    try:
        entries = sorted(parent.iterdir())[:1000] if parent.is_dir() else []
    except OSError:
        return []
    return [p.name if parent == Path(".") else str(parent / p.name) for p in entries]
