"""Sluice's clients: ``sluice chat`` / ``sluice complete`` (a streaming terminal client) and
``sluice bench`` (a load generator). They speak the OpenAI HTTP API to any compatible server and
import nothing of the server's packages."""
