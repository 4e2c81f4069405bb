"""Chat templates end to end against ``transformers``: a model directory's template (inline, in
the named-list form, or in ``chat_template.jinja``) is read by the worker, rendered by the
frontend, and gives the text and the token ids ``apply_chat_template`` gives.

The templates below are written for these tests in the styles real checkpoints use: header
tokens with a dated system prompt, ChatML with JSON tool schemas, [INST] turns that reject bad
role orders, loop controls and ``{% generation %}`` blocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from frontend.tokenizer import ChatTemplateError, ModelTokenizer
from worker.model.config import LlamaConfig
from worker.model.info import build_model_info
from worker.model.tiny import build_byte_level_tokenizer

HEADERS = (
    "{{- bos_token }}{%- set date = strftime_now('%d %b %Y') %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'You are helpful.' %}{%- endif %}"
    "<|start|>system<|sep|>\n\nToday: {{ date }}\n{{ system }}<|end|>"
    "{%- for message in messages %}"
    "<|start|>{{ message['role'] }}<|sep|>\n\n{{ message['content'] | trim }}<|end|>"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant<|sep|>\n\n{%- endif %}"
)
CHATML = (
    "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}"
    "<|im_end|>\n{%- elif messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == 'tool' %}<|im_start|>tool\n{{ message['content'] | tojson }}<|im_end|>\n"
    "    {%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}\n"
)
INST = (
    "{{ bos_token }}{% set ns = namespace(turn=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{% if (message['role'] == 'user') != (ns.turn % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if message['role'] == 'user' %}[INST] {{ message['content'] }} [/INST]"
    "{% else %}{% generation %}{{ message['content'] }}{% endgeneration %}{{ eos_token }}{% endif %}"
    "{% set ns.turn = ns.turn + 1 %}"
    "{% if message['content'] == 'STOP' %}{% break %}{% endif %}"
    "{% endfor %}"
)

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there!"}],
    [{"role": "system", "content": "  You answer in French.  "}, {"role": "user", "content": "Où est <b>café</b> & 'thé'?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?\n"}],
    [{"role": "user", "content": "STOP"}, {"role": "assistant", "content": "never shown"},
     {"role": "user", "content": "nor this"}],
    [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "calling"},
     {"role": "tool", "content": "{\"temp\": \"12°C <cold>\"}"}],
]


def _model_dir(path: Path, template_files: dict[str, Any], bos: str | None = "<s>") -> Path:
    path.mkdir()
    build_byte_level_tokenizer(320).save(str(path / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "</s>",
               "add_bos_token": bos is not None}
    for name, value in template_files.items():
        if name == "chat_template.jinja":
            (path / name).write_text(value)
        else:
            tok_cfg[name] = value
    (path / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2}))
    return path


def _sluice(path: Path) -> ModelTokenizer:
    """What the worker reads from the directory and the frontend makes of it (no weights needed)."""
    cfg = LlamaConfig.from_file(path / "config.json")
    info = build_model_info(path, cfg, name="t", max_model_len=256, num_kv_blocks=4, block_size=16)
    return ModelTokenizer(info)


def _hf(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize(("template_files", "bos"), [
    ({"chat_template": HEADERS}, "<s>"),
    ({"chat_template": CHATML}, None),
    ({"chat_template": [{"name": "default", "template": INST}, {"name": "tool_use", "template": CHATML}]}, "<s>"),
    ({"chat_template.jinja": CHATML}, "<s>"),  # no BOS in the template: none in the ids either
], ids=["headers", "chatml", "named-list", "jinja-file"])
def test_rendered_text_and_ids_equal_transformers(tmp_path: Path, template_files: dict[str, Any],
                                                  bos: str | None) -> None:
    path = _model_dir(tmp_path / "model", template_files, bos)
    ours, hf = _sluice(path), _hf(path)
    for messages in CONVERSATIONS:
        try:
            want_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the INST template rejects a conversation: so must we
            with pytest.raises(ChatTemplateError, match="roles must alternate"):
                ours.render_chat(messages)
            assert "roles must alternate" in str(e)
            continue
        assert ours.render_chat(messages) == want_text
        want_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert ours.encode_chat(messages) == list(want_ids)


def test_tools_and_documents_are_none_as_in_transformers(tmp_path: Path) -> None:
    template = "{{ 'tools=' ~ (tools is none) ~ ' documents=' ~ (documents is none) }}"
    path = _model_dir(tmp_path / "model", {"chat_template": template})
    messages = CONVERSATIONS[0]
    assert _sluice(path).render_chat(messages) == _hf(path).apply_chat_template(messages, tokenize=False)


def test_without_a_template_the_plain_default_starts_with_bos(tmp_path: Path) -> None:
    ours = _sluice(_model_dir(tmp_path / "model", {}))
    assert ours.render_chat(CONVERSATIONS[2]) == "user: 2+2?\nassistant: 4\nuser: And 3+3?\n\nassistant:"
    assert ours.encode_chat(CONVERSATIONS[0])[0] == 1


def test_a_template_that_does_not_parse_fails_chat_requests_only(tmp_path: Path) -> None:
    ours = _sluice(_model_dir(tmp_path / "model", {"chat_template": "{% for m in messages %}{{ m['content'] }}"}))
    with pytest.raises(ChatTemplateError, match=r"chat template does not parse \(line 1: "):
        ours.encode_chat(CONVERSATIONS[0])
    assert ours.encode_prompt("hi")[0] == 1


def test_eos_token_in_the_template_is_the_tokenizer_configs(tmp_path: Path) -> None:
    """generation_config lists several EOS ids (all stop generation); the template's
    ``eos_token`` is the tokenizer config's, as in transformers."""
    path = _model_dir(tmp_path / "model", {"chat_template": INST, "eos_token": "<s>"})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1]}))
    ours = _sluice(path)
    assert ours.info.eos_token_ids == [1, 2]
    messages = CONVERSATIONS[2]
    assert ours.render_chat(messages) == _hf(path).apply_chat_template(messages, tokenize=False)
