"""``sluice convert``: SmolLM2's GGUF file as a Hugging Face directory that Sluice and
``transformers`` both load to the very weights, tokenizer and chat template of the GGUF file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from protocol.config import WorkerConfig
from worker.engine import Worker
from worker.gguf.convert import convert
from worker.model.config import ModelLoadError
from worker.model.loader import smollm2_path

pytestmark = pytest.mark.timeout(600)

TEXTS = ["What is the capital of France?", "naïve café 日本語 🎉", "  spaced\n\nlines\t", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("convert") / "smollm2-hf"
    done = subprocess.run([sys.executable, "-m", "frontend", "convert", "smollm2", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"sluice serve --model {out}" in done.stdout
    return out


@pytest.fixture(scope="module")
def from_gguf() -> Worker:
    return Worker(WorkerConfig(model="smollm2", num_kv_blocks=8, dtype="float32"))


def test_sluice_loads_the_directory_as_the_gguf_file(converted: Path, from_gguf: Worker) -> None:
    from_dir = Worker(WorkerConfig(model=str(converted), num_kv_blocks=8, dtype="float32"))
    theirs = from_gguf.runner.model.checkpoint_state()
    ours = from_dir.runner.model.checkpoint_state()
    assert theirs.keys() == ours.keys()
    for name, p in ours.items():
        assert torch.equal(p, theirs[name]), name
    a, b = from_dir.info, from_gguf.info
    assert a.name == "smollm2-hf"  # served under the directory's name, not its whole path
    mask = os.umask(0)
    os.umask(mask)
    assert {p.name: p.stat().st_mode & 0o777 for p in converted.iterdir()} == {
        p.name: 0o666 & ~mask for p in converted.iterdir()}  # the weights too, not just the json
    assert (a.eos_token_ids, a.bos_token_id, a.add_bos_token, a.chat_template, a.vocab_size, a.max_model_len) == (
        b.eos_token_ids, b.bos_token_id, b.add_bos_token, b.chat_template, b.vocab_size, b.max_model_len)
    # The model card's sampling defaults travel in generation_config.json: the same as the file's.
    assert a.sampling_defaults == b.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}
    dir_tok, gguf_tok = Tokenizer.from_str(a.tokenizer_json), Tokenizer.from_str(b.tokenizer_json)
    for text in TEXTS:
        assert dir_tok.encode(text).ids == gguf_tok.encode(text).ids, text


def test_transformers_loads_the_directory_to_the_same_weights_and_tokenizer(converted: Path,
                                                                           from_gguf: Worker) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    ours = from_gguf.runner.model.checkpoint_state()
    theirs = model.state_dict()
    assert set(ours) <= set(theirs)
    for name, p in ours.items():
        assert torch.equal(theirs[name], p), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the file

    # Our GGUF tokenizer is transformers' GGUF tokenizer (test_gguf), so comparing with ours is enough.
    hf_tok = AutoTokenizer.from_pretrained(str(converted))
    ours_tok = Tokenizer.from_str(from_gguf.info.tokenizer_json)
    for text in TEXTS:
        assert hf_tok(text).input_ids == ours_tok.encode(text).ids, text
    assert hf_tok.chat_template == from_gguf.info.chat_template
    assert (hf_tok.eos_token, hf_tok.bos_token) == ("<|im_end|>", "<|im_start|>")


def test_convert_refuses_a_directory_with_files(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(ModelLoadError, match="exists and is not an empty directory"):
        convert(smollm2_path(), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
