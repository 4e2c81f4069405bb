"""The tokenizer a GGUF file describes, rebuilt as a ``tokenizers`` tokenizer.

A GGUF file carries no tokenizer.json, only llama.cpp's description: ``tokenizer.ggml.model``
(the algorithm), ``.tokens`` and ``.merges``, ``.token_type`` per token and ``.pre`` (which
text-splitting rule the merges were learned with). Sluice builds what ``transformers`` builds
from the same file, so both encode every text to the same ids:

* the vocabulary spelled in GPT-2's byte alphabet — most tokens already are; a token that is
  not (an added token written as plain text) is re-spelled byte by byte;
* CONTROL tokens (``<|im_end|>``) as special tokens, USER_DEFINED ones (``<think>``) as plain
  added tokens, so neither is ever cut into pieces;
* the split rule: Llama 3's for the ``.pre`` values that name it, GPT-2's (the byte-level
  pre-tokenizer's own) otherwise.

Only byte-level BPE (``gpt2``) is built; sentencepiece-style vocabularies are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (tokenizer.ggml.token_type).
CONTROL = 3
USER_DEFINED = 4

# Llama 3's split: contractions, letter runs with one leading non-letter, digits in threes,
# punctuation runs, newlines, other whitespace.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {pre: _LLAMA3_SPLIT for pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "dbrx")}


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
    if kind != "gpt2":
        raise UnsupportedTokenizer(f"GGUF tokenizer model {kind!r} is not supported (only gpt2 byte-level BPE)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type", [])
    spell = byte_alphabet()
    alphabet = set(spell.values())
    vocab = {(t if set(t) <= alphabet else "".join(spell[b] for b in t.encode())): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    split = _SPLITS.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # A CONTROL token spelled outside the byte alphabet is a mislabel in the file: it already
    # sits in the vocabulary re-spelled, and adding it as written would grow the vocabulary
    # past the model's embedding rows.
    control = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
    return tok
