"""The model families Sluice serves, one module each: what sets the family apart from the shared
decoder (``worker/model/llama.py``), read from its ``config.json``, what of its files it cannot
serve, its tensor names where they differ from the model's, and its GGUF architecture names. A
new family is a module here, its flags in ``LlamaConfig`` where the decoder lacks a building
block, and its tests (``tests/test_worker_parity.py`` checks each against ``transformers``)."""

from __future__ import annotations

from worker.model.families import gemma, llama, mixtral, olmoe, phi, qwen
from worker.model.families.base import Family

FAMILIES: dict[str, Family] = {arch: family for module in (llama, qwen, mixtral, olmoe, phi, gemma)
                               for family in module.FAMILIES for arch in family.architectures}
# GGUF's architecture names (``general.architecture``), as llama.cpp's converter writes them
GGUF_ARCHITECTURES: dict[str, str] = {gguf: arch for family in FAMILIES.values() for gguf, arch in family.gguf.items()}


def family_of(architecture: str) -> Family:
    return FAMILIES[architecture]


__all__ = ["FAMILIES", "GGUF_ARCHITECTURES", "Family", "family_of"]
