"""Sluice's model worker: Llama-family models in torch, paged KV cache, multi-step execution."""
