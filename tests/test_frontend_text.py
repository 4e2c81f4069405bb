"""Unit tests of the frontend's text path: tokenizer wrapper, incremental detokenizer, stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from frontend.tokenizer import IncrementalDetokenizer, ModelTokenizer, StopStringMatcher
from protocol.messages import ModelInfo

TEXT = ("The quick brown fox jumps over the lazy dog. Ünïcödé text, emoji 🦊 and 日本語 too. " * 20).split(". ")


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    info = ModelInfo(
        name="test", max_model_len=512, vocab_size=tok.get_vocab_size(), eos_token_ids=[2], bos_token_id=1,
        tokenizer_json=tok.to_str(), chat_template=None, add_bos_token=True, num_kv_blocks=8, block_size=16,
    )
    return ModelTokenizer(info)


def test_encode_prompt_adds_bos_once(tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.encode_prompt("hello fox")
    assert ids[0] == 1 and ids.count(1) == 1
    assert tokenizer.decode(ids) == "hello fox"


@pytest.mark.parametrize("text", ["The lazy fox 🦊 says 日本語!", "Ünïcödé", "a" * 50, " leading space"])
def test_incremental_detokenizer_matches_full_decode(tokenizer: ModelTokenizer, text: str) -> None:
    prompt = tokenizer.encode_prompt("Prompt:")
    ids = tokenizer.encode_prompt(text)[1:]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    streamed = "".join(detok.push(t) for t in ids)
    assert streamed == tokenizer.decode(ids)


def _byte_level_char(b: int) -> str:
    """The GPT-2 byte-level alphabet: printable bytes stand for themselves, the rest map to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def test_incremental_detokenizer_waits_for_whole_characters(tokenizer: ModelTokenizer) -> None:
    # The 4 bytes of one emoji as 4 single-byte tokens: no text until the character is whole.
    byte_ids = [tokenizer._tok.token_to_id(_byte_level_char(b)) for b in "🦊".encode()]
    assert None not in byte_ids
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push(t) for t in byte_ids]
    assert deltas == ["", "", "", "🦊"]


def test_stop_string_cuts_text_and_holds_back_prefixes() -> None:
    m = StopStringMatcher(["STOP", "\n\n"])
    out, stopped = m.feed("Hello ST")
    assert (out, stopped) == ("Hello", False)  # "ST" might begin "STOP": held back
    out, stopped = m.feed("ar")
    assert not stopped
    out2, stopped = m.feed(" and STOP here")
    assert stopped
    assert out + out2 == " STar and "


def test_stop_string_across_deltas_and_flush() -> None:
    m = StopStringMatcher(["<end>"])
    pieces = [m.feed(c) for c in "abc<en"]
    assert not any(s for _, s in pieces)
    assert "".join(p for p, _ in pieces) + m.flush() == "abc<en"


def test_no_stop_strings_passes_through() -> None:
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


def test_default_chat_template_renders(tokenizer: ModelTokenizer) -> None:
    text = tokenizer.render_chat([{"role": "user", "content": "Hi"}])
    assert text == "user: Hi\nassistant:"
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids[0] == 1
