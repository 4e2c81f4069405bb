"""A mixture of experts against ``transformers``' on the same checkpoint (Qwen3-MoE: 6 experts, 3
per token, its first layer a mixture), layer by layer: each token's routing (its experts, in
order, and their weights) is transformers' token for token, and the layer's output is
transformers' block's, for a batch of ordinary hidden states, for one whose tokens all choose
the same expert first (that expert's group holds every token), and for one spread over every
expert. The whole model's greedy parity is ``test_worker_parity.py``'s."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from checkpoints import save_qwen3_moe
from safetensors.torch import load_file, save_file

from worker.model.config import LlamaConfig
from worker.model.llama import SparseMoE
from worker.model.loader import load_model

FAVOURITE = 4  # the expert every token of the "one expert" batch chooses first
ROUTER = "model.layers.0.mlp.gate.weight"


@pytest.fixture(scope="module")
def layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[SparseMoE, Any, SparseMoE, Any]:
    """Layer 0's mixture in Sluice and in transformers, from the checkpoint as saved and from a copy
    whose router favours expert ``FAVOURITE`` for any input with positive entries."""
    from transformers import AutoModelForCausalLM

    ckpt = save_qwen3_moe(tmp_path_factory.mktemp("moe") / "ckpt")
    favoured = tmp_path_factory.mktemp("favoured") / "ckpt"
    favoured.mkdir()
    for f in ckpt.iterdir():
        (favoured / f.name).write_bytes(f.read_bytes())
    for shard in favoured.glob("*.safetensors"):
        state = load_file(shard)
        if ROUTER in state:
            router = 0.01 * torch.randn(state[ROUTER].shape, generator=torch.Generator().manual_seed(0))
            router[FAVOURITE] = 0.5  # every positive input: this expert's logit far above the others'
            state[ROUTER] = router
            save_file(state, str(shard), metadata={"format": "pt"})
    out = []
    for path in (ckpt, favoured):
        cfg = LlamaConfig.from_file(path / "config.json")
        ours = load_model(path, cfg, torch.float32, torch.device("cpu"), 64).model.decoder_layers()[0].mlp
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval().model.layers[0].mlp
        assert isinstance(ours, SparseMoE)
        out += [ours, theirs]
    return out[0], out[1], out[2], out[3]


def _compare(ours: SparseMoE, theirs: Any, x: torch.Tensor) -> torch.Tensor:
    """Routing token for token and the layer's output against transformers; returns the experts
    each token chose."""
    with torch.inference_mode():
        weights, chosen = ours.route(x)
        _, their_weights, their_chosen = theirs.gate(x)
        assert torch.equal(chosen, their_chosen)
        torch.testing.assert_close(weights, their_weights.float(), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(ours(x), theirs(x.unsqueeze(0)).squeeze(0), atol=1e-5, rtol=1e-4)
    return chosen


def test_routing_and_output_are_transformers_token_for_token(layers: tuple[SparseMoE, Any, SparseMoE, Any]) -> None:
    ours, theirs, _, _ = layers
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(1))
    _compare(ours, theirs, x)


def test_a_batch_whose_tokens_all_choose_one_expert(layers: tuple[SparseMoE, Any, SparseMoE, Any]) -> None:
    _, _, ours, theirs = layers
    x = torch.rand(31, 64, generator=torch.Generator().manual_seed(2)) + 0.1  # positive: the favourite's
    chosen = _compare(ours, theirs, x)
    assert (chosen[:, 0] == FAVOURITE).all()  # its group: every token of the batch


def test_a_batch_spread_over_every_expert(layers: tuple[SparseMoE, Any, SparseMoE, Any]) -> None:
    ours, theirs, _, _ = layers
    x = 3 * torch.randn(64, 64, generator=torch.Generator().manual_seed(3))
    chosen = _compare(ours, theirs, x)
    counts = torch.bincount(chosen.flatten(), minlength=len(ours.experts))
    assert (counts > 0).all() and int(counts.max()) < 64, counts.tolist()  # every expert runs, none takes all
