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
    # Names compared with names: whole paths share their directory, which made any entry "close".
    siblings = _siblings(path)
    near = (difflib.get_close_matches(model, BUILTIN_MODELS, n=1, cutoff=0.6)
            or [siblings[n] for n in difflib.get_close_matches(path.name, list(siblings), n=1, cutoff=0.6)])
    hint = f"; did you mean {near[0]!r}?" if near else ""
    return (f"--model {model}: {what}{hint} (--model takes 'smollm2', 'tiny', a .gguf file, a Hugging "
            f"Face-format directory or a Hugging Face Hub id)")


def _siblings(path: Path) -> dict[str, str]:
    """The models beside a mistyped path, by name, spelt as the user would type them (a typo in
    its last part): ``.gguf`` files and directories with a ``config.json``, never any file that
    happens to be near (``/tmp/nope.gguf`` once suggested ``/tmp/rc-openai.out``)."""
    parent = path.parent
    try:
        entries = sorted(parent.iterdir())[:1000] if parent.is_dir() else []
    except OSError:
        return {}
    return {p.name: p.name if parent == Path(".") else str(parent / p.name) for p in entries if _could_be_a_model(p)}


def _could_be_a_model(path: Path) -> bool:
    try:
        return (path.suffix == ".gguf" and path.is_file()) or (path.is_dir() and (path / "config.json").is_file())
    except OSError:
        return False
