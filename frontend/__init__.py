"""Sluice's HTTP frontend: OpenAI-compatible API, SSE streaming, and the ``sluice`` command."""
