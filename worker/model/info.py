"""``ModelInfo``: what the frontend must know about the model, read from the model directory.

The frontend never reads model files; this is where their tokenizer-side facts are decided:

* ``eos_token_ids``: ``generation_config.json``'s ``eos_token_id`` (an int or a list), else
  ``config.json``'s, else the tokenizer config's ``eos_token``. The tokenizer config's
  ``eos_token`` goes first when it is one of them: the frontend gives the first one's text to
  the chat template as ``eos_token``, which is what ``transformers`` gives it (Llama 3.1
  Instruct: ``<|eot_id|>``, not ``<|end_of_text|>``).
* ``bos_token_id``: the id of ``tokenizer_config.json``'s ``bos_token`` when that key exists
  (``null`` means the model has none), else ``config.json``'s ``bos_token_id``.
* ``add_bos_token`` — whether prompts start with BOS — follows what ``transformers`` does:
  the tokenizer config's explicit ``add_bos_token``; else True when ``tokenizer.json``'s
  post-processor already inserts BOS; else True for the sentencepiece-style Llama tokenizer
  classes (LlamaTokenizer, CodeLlamaTokenizer, GemmaTokenizer: their default is True); else
  False (GPT-2/Qwen2-style byte-level tokenizers, which add nothing). The frontend never adds a
  second BOS when the ids already start with one.
* ``chat_template``: ``tokenizer_config.json``'s (a string, or the named-list form's
  ``default``), else ``chat_template.jinja``, else ``chat_template.json``'s (where an
  image-and-text model's processor keeps it), else None (the frontend's plain default);
  ``tool_chat_template``: the named-list form's ``tool_use``, which requests with tools get.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from protocol.messages import ModelInfo
from worker.gguf.checkpoint import GGUFCheckpoint
from worker.model.config import LlamaConfig, ModelLoadError

_BOS_BY_DEFAULT_CLASSES = ("LlamaTokenizer", "LlamaTokenizerFast", "CodeLlamaTokenizer", "CodeLlamaTokenizerFast",
                           "GemmaTokenizer", "GemmaTokenizerFast")


def _json_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    return raw if isinstance(raw, dict) else {}


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: object) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value]
    return []


def _load_tokenizer(path: Path) -> tuple[str, Tokenizer]:
    if not path.exists():
        raise ModelLoadError(f"{path}: missing (Sluice needs a `tokenizers` tokenizer.json)")
    text = path.read_text()
    try:
        return text, Tokenizer.from_str(text)
    except Exception as e:  # the tokenizers library raises plain Exception subclasses
        raise ModelLoadError(f"{path}: not a tokenizers tokenizer ({e})") from None


def _chat_template(model_dir: Path, tok_cfg: dict[str, Any], name: str = "default") -> str | None:
    """The template of that name: ``default``, or ``tool_use`` (the named-list form only)."""
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # the list-of-named-templates form
        template = next((t.get("template") for t in template if t.get("name") == name), None)
    elif name != "default":
        return None
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and name == "default" and jinja_file.exists():
        template = jinja_file.read_text()
    if template is None and name == "default":  # an image-and-text checkpoint's processor keeps it here
        template = _json_file(model_dir / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def _bos_token_id(tok_cfg: dict[str, Any], tokenizer: Tokenizer, cfg: LlamaConfig) -> int | None:
    if "bos_token" in tok_cfg:
        content = _token_content(tok_cfg["bos_token"])
        if content is None:
            return None
        found = tokenizer.token_to_id(content)
        return found if found is not None else cfg.bos_token_id
    return cfg.bos_token_id


def _add_bos_token(tok_cfg: dict[str, Any], tokenizer: Tokenizer, bos: int | None) -> bool:
    if bos is None:
        return False
    explicit = tok_cfg.get("add_bos_token")
    if isinstance(explicit, bool):
        return explicit
    probe = tokenizer.encode("a", add_special_tokens=True).ids
    if probe and probe[0] == bos:
        return True
    return tok_cfg.get("tokenizer_class") in _BOS_BY_DEFAULT_CLASSES


def build_gguf_model_info(checkpoint: GGUFCheckpoint, cfg: LlamaConfig, *, name: str, max_model_len: int,
                          num_kv_blocks: int, block_size: int) -> ModelInfo:
    """The same facts from a GGUF file's metadata: its tokenizer, chat template, BOS/EOS ids and
    whether prompts start with BOS (``tokenizer.ggml.add_bos_token``)."""
    tokenizer = checkpoint.tokenizer()
    return ModelInfo(
        name=name,
        max_model_len=max_model_len,
        vocab_size=cfg.vocab_size,
        eos_token_ids=cfg.eos_token_ids,
        bos_token_id=cfg.bos_token_id,
        tokenizer_json=tokenizer.to_str(),
        chat_template=checkpoint.chat_template(),
        tool_chat_template=checkpoint.chat_template("tool_use"),
        add_bos_token=checkpoint.add_bos_token() and cfg.bos_token_id is not None,
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        hidden_size=cfg.hidden_size,
    )


def build_model_info(model_dir: Path, cfg: LlamaConfig, *, name: str, max_model_len: int, num_kv_blocks: int,
                     block_size: int) -> ModelInfo:
    tok_cfg = _json_file(model_dir / "tokenizer_config.json")
    tokenizer_json, tokenizer = _load_tokenizer(model_dir / "tokenizer.json")
    eos = _ids(_json_file(model_dir / "generation_config.json").get("eos_token_id")) or cfg.eos_token_ids
    eos_content = _token_content(tok_cfg.get("eos_token"))
    eos_id = tokenizer.token_to_id(eos_content) if eos_content else None
    if not eos:
        eos = [] if eos_id is None else [eos_id]
    elif eos_id in eos:
        eos = [eos_id, *(e for e in eos if e != eos_id)]
    bos = _bos_token_id(tok_cfg, tokenizer, cfg)
    return ModelInfo(
        name=name,
        max_model_len=max_model_len,
        vocab_size=cfg.vocab_size,
        eos_token_ids=eos,
        bos_token_id=bos,
        tokenizer_json=tokenizer_json,
        chat_template=_chat_template(model_dir, tok_cfg),
        tool_chat_template=_chat_template(model_dir, tok_cfg, "tool_use"),
        add_bos_token=_add_bos_token(tok_cfg, tokenizer, bos),
        num_kv_blocks=num_kv_blocks,
        block_size=block_size,
        hidden_size=cfg.hidden_size,
    )
