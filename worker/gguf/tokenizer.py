"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers`` tokenizer.

A GGUF file carries no tokenizer.json, only llama.cpp's description: ``tokenizer.ggml.model``
(the algorithm), ``.tokens``, ``.merges`` or ``.scores``, ``.token_type`` per token and ``.pre``
(which text-splitting rule the merges were learned with). Sluice builds what ``transformers``
builds from the same file, so both encode every text to the same ids.

Byte-level BPE (``gpt2``: GPT-2, Llama 3, SmolLM, Qwen...):

* the vocabulary spelled in GPT-2's byte alphabet — most tokens already are; a token that is
  not (an added token written as plain text) is re-spelled byte by byte;
* the split rule: Llama 3's for the ``.pre`` values that name it, GPT-2's (the byte-level
  pre-tokenizer's own) otherwise.

SentencePiece BPE (``llama``: Llama 2, Mistral, TinyLlama...):

* pieces as written (``▁`` for a space), unknown characters as ``<0xNN>`` byte tokens;
* no merges in the file: they follow from the scores (see ``merges_from_scores``);
* a ``▁`` before the text's first word, and removed again when decoding.

Both: CONTROL tokens (``<|im_end|>``) and the BOS/EOS/UNK/PAD tokens as special tokens,
USER_DEFINED ones (``<think>``) as plain added tokens, so none is ever cut into pieces.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

log = logging.getLogger("sluice.worker")

# llama.cpp token types (tokenizer.ggml.token_type).
CONTROL = 3
USER_DEFINED = 4
SPACE = "\u2581"  # how SentencePiece writes a space inside a piece
_NAMED_SPECIAL = ("bos", "eos", "unknown", "padding")  # tokenizer.ggml.<name>_token_id

# Llama 3's split: contractions, letter runs with one leading non-letter, digits in threes,
# punctuation runs, newlines, other whitespace.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (and Qwen3's): Llama 3's, with every digit on its own.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {pre: _LLAMA3_SPLIT for pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")}
_SPLITS["qwen2"] = _QWEN2_SPLIT
# Names of GPT-2's own rule, and SmolLM's (no token of its vocabulary holds a digit beside anything
# else: splitting digits apart first, as its tokenizer does, gives the same ids)
_GPT2_SPLIT_NAMES = ("", "default", "gpt-2", "gpt2", "smollm")


class UnsupportedTokenizer(ValueError):
    pass


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level vocabularies use:
    printable Latin-1 bytes stand for themselves, the others for code points from 256 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def build_tokenizer(metadata: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer of a GGUF file's ``metadata`` (key -> value, as ``GGUFFile`` reads it)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok, spelled = _byte_level(metadata)
    elif kind == "llama":
        tok, spelled = _sentencepiece(metadata), None
    else:
        raise UnsupportedTokenizer(f"GGUF tokenizer model {kind!r} is not supported (only gpt2 byte-level BPE "
                                   f"and llama sentencepiece BPE)")
    _add_special_tokens(tok, metadata, spelled)
    return tok


def _byte_level(metadata: Mapping[str, Any]) -> tuple[Tokenizer, set[str]]:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    spell = byte_alphabet()
    alphabet = set(spell.values())
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    pre = metadata.get("tokenizer.ggml.pre", "")
    split = _SPLITS.get(pre)
    if split is None:
        if pre not in _GPT2_SPLIT_NAMES:
            log.warning("GGUF tokenizer: the split rule %r is not one Sluice knows; splitting text by GPT-2's rule, "
                        "which may cut some texts (digits, other scripts) otherwise than llama.cpp does", pre)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, alphabet


def _sentencepiece(metadata: Mapping[str, Any]) -> Tokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    vocab = {t: i for i, t in enumerate(tokens)}
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_scores(tokens, metadata["tokenizer.ggml.scores"], vocab)
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True))
    # transformers prepends the space whatever tokenizer.ggml.add_space_prefix says; so does this.
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def merges_from_scores(tokens: list[str], scores: list[float], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE keeps a score per piece instead of a merge list. Every way to cut a
    piece into two pieces of the vocabulary is a merge, ranked by the piece's score (highest
    first), then by longer left and longer right parts; ties keep vocabulary order (the order of
    the whole piece, then of its parts' ids) — the order ``transformers`` derives."""
    found: list[tuple[float, str, str]] = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        cuts = [(piece[:i], piece[i:]) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab]
        cuts.sort(key=lambda cut: (vocab[cut[0]], vocab[cut[1]]))
        found.extend((score, left, right) for left, right in cuts)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)  # stable: ties keep their order
    return [(left, right) for _, left, right in found]


def _add_special_tokens(tok: Tokenizer, metadata: Mapping[str, Any], spelled: set[str] | None) -> None:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
    named = [int(metadata[f"tokenizer.ggml.{n}_token_id"]) for n in _NAMED_SPECIAL
             if f"tokenizer.ggml.{n}_token_id" in metadata]
    special = [tokens[i] for i in named if 0 <= i < len(tokens)]
    special += [t for t, k in zip(tokens, types, strict=False) if k == CONTROL]
    # A special token spelled outside the byte alphabet is a mislabel in the file: it already
    # sits in the vocabulary re-spelled, and adding it as written would grow the vocabulary
    # past the model's embedding rows.
    if spelled is not None:
        special = [t for t in special if set(t) <= spelled]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in dict.fromkeys(special)])
    vocab = tok.get_vocab(with_added_tokens=False)
    user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
