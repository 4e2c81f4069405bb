"""Sluice's scheduler: request queues, continuous batching under a token budget, KV block accounting."""
