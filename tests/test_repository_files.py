"""What the repository carries: no file over 1 MB unless it is named here, and no downloaded
archives or wheels at all. A commit once put 93 MB of them at the root (llama-cpp-python's source,
a numpy wheel, ...): every clone carried them, and nothing used them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 1 << 20
# Files allowed over LIMIT, each with why: none today.
ALLOWED: dict[str, str] = {}
DOWNLOADS = (".whl", ".tar.gz", ".tgz", ".zip", ".gguf", ".safetensors", ".bin", ".pt")


def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in done.stdout.decode().split("\0") if p]


def test_no_tracked_file_is_over_1_mb_unless_allowed() -> None:
    big = {p: (ROOT / p).stat().st_size for p in tracked() if (ROOT / p).is_file() and (ROOT / p).stat().st_size > LIMIT}
    assert set(big) <= set(ALLOWED), f"over 1 MB and not in ALLOWED: {big}"


def test_no_downloaded_archive_or_weights_is_tracked() -> None:
    found = [p for p in tracked() if p.endswith(DOWNLOADS)]
    assert not found, found


def test_gitignore_keeps_them_out() -> None:
    names = ["x.whl", "x.tar.gz", "x.gguf", "docker/wheels/torch.whl"]
    done = subprocess.run(["git", "check-ignore", "--no-index", *names], cwd=ROOT, capture_output=True, text=True)
    assert sorted(done.stdout.split()) == sorted(names), done.stdout
