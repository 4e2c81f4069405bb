"""What ``--model`` may name and the hint a mistyped one gets (``protocol.models``)."""

from __future__ import annotations

import json
from pathlib import Path

from protocol.models import unknown_model


def test_a_mistyped_path_is_offered_only_models_beside_it(tmp_path: Path) -> None:
    (tmp_path / "rc-openai.out").write_text("log")  # near in spelling, not a model
    (tmp_path / "nope.ggml").write_text("x")
    (tmp_path / "notes").mkdir()
    assert "did you mean" not in (unknown_model(str(tmp_path / "nope.gguf")) or "")
    (tmp_path / "nope-q4.gguf").write_bytes(b"GGUF")
    (tmp_path / "llama-3").mkdir()
    (tmp_path / "llama-3" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert f"did you mean '{tmp_path / 'nope-q4.gguf'}'?" in (unknown_model(str(tmp_path / "nope.gguf")) or "")
    assert f"did you mean '{tmp_path / 'llama-3'}'?" in (unknown_model(str(tmp_path / "llama-2")) or "")
    assert "did you mean" not in (unknown_model(str(tmp_path / "note")) or "")  # a directory, but no model in it


def test_names_that_could_load_are_not_questioned(tmp_path: Path) -> None:
    assert unknown_model("smollm2") is None and unknown_model("tiny") is None
    assert unknown_model("HuggingFaceTB/SmolLM2-135M-Instruct") is None
    assert unknown_model(str(tmp_path)) is None
    assert "did you mean 'smollm2'?" in (unknown_model("smollm3") or "")
