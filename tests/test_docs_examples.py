"""The README's and docs/' examples run as written against ``sluice serve`` with its defaults.

A block marked ``<!-- run by tests/test_docs_examples.py -->`` is run unchanged but for the port
(``127.0.0.1:8000`` / ``localhost:8000`` become the test server's): a ``bash`` block with bash, a
``python`` block with this interpreter. It must exit 0 and print no error, and where the block
says what comes out, in a comment, it must come out:

- in ``bash``, a comment line of its own, ``# ... "content": "The capital of France is Paris." ...``:
  that text, ``...`` standing for anything, somewhere in the output;
- in ``python``, a comment after a ``print``: that print's line of output, ``...`` for anything.

Before: the structured-output example never finished with the default model (a JSON integer
written until the context was full), and the tool-calling one parroted the tool's result back.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sluice_server import SluiceServer, running_server

pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parent.parent
MARK = "<!-- run by tests/test_docs_examples.py -->"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}"


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            fence = lines[i + 1]
            assert fence.startswith("```"), f"{page.name}:{i + 1}: the mark must stand right above a code block"
            end = lines.index("```", i + 2)
            found.append(Example(str(page.relative_to(ROOT)), i + 2, fence[3:].strip(), "\n".join(lines[i + 2:end])))
    return found


EXAMPLES = examples()


def test_the_pages_mark_their_examples() -> None:
    pages = {e.page for e in EXAMPLES}
    assert {"README.md", "docs/structured-output.md"} <= pages, pages
    assert all(e.language in ("bash", "python") for e in EXAMPLES), EXAMPLES


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceServer]:
    # The README's `sluice serve`: the default model and dtype (SluiceServer would pin float32).
    with running_server("--model", "smollm2", "--dtype", "auto", log_dir=tmp_path_factory.mktemp("docs")) as s:
        yield s


def _pattern(expected: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(part.strip()) for part in expected.split("...")))


def bash_expectations(code: str) -> list[str]:
    return [line.strip()[1:].strip() for line in code.splitlines() if line.strip().startswith("# ...")]


def python_expectations(code: str) -> list[str]:
    """The comments after ``print(...)`` calls, in the order the calls run (top to bottom)."""
    tree = ast.parse(code)
    prints = sorted(n.lineno for n in ast.walk(tree)
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print")
    lines = code.splitlines()
    return [lines[n - 1].split("#", 1)[1].strip() for n in prints if "#" in lines[n - 1]]


@pytest.mark.parametrize("example", EXAMPLES, ids=str)
def test_the_example_runs_as_written(server: SluiceServer, example: Example, tmp_path: Path) -> None:
    code = re.sub(r"(127\.0\.0\.1|localhost):8000", f"127.0.0.1:{server.port}", example.code)
    if example.language == "bash":
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True, timeout=600,
                              cwd=tmp_path)
        expected = bash_expectations(example.code)
    else:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path)
        expected = python_expectations(example.code)
    said = f"{example}:\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    assert done.returncode == 0, said
    assert done.stdout.strip(), said
    assert '"error"' not in done.stdout, said
    if example.language == "bash":
        for want in expected:
            assert _pattern(want).search(done.stdout), f"{want!r} not in the output of {said}"
    else:
        out = done.stdout.splitlines()
        assert len(out) >= len(expected), said
        # Each commented print's line, in order (a print of several lines: its first).
        position = 0
        for want in expected:
            while position < len(out) and not _pattern(want).fullmatch(out[position].strip()):
                position += 1
            assert position < len(out), f"no line {want!r} in the output of {said}"
            position += 1
