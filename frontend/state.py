"""What the HTTP handlers share: config, the engine link, and the model's tokenizer."""

from __future__ import annotations

import hmac
import time

from starlette.requests import Request

from frontend.engines import EngineGroup
from frontend.errors import APIError
from frontend.metrics import Metrics
from frontend.responses_store import ResponseStore
from frontend.structured import GrammarValidator
from frontend.tokenizer import ModelTokenizer
from protocol.config import FrontendConfig
from protocol.heap import return_freed_memory
from protocol.messages import ModelInfo


class AppState:
    def __init__(self, config: FrontendConfig, client: EngineGroup, responses: ResponseStore | None = None) -> None:
        self.config = config
        self.responses = responses  # the Responses API's stored responses; None: none are kept
        self.client = client
        self.started = int(time.time())
        self._tokenizer: ModelTokenizer | None = None
        self.draining = False  # shutting down: no new requests
        self.grammars = GrammarValidator()
        self.metrics = Metrics(lambda: client.stats, lambda: self.model_name, client.engine_stats)
        client.attach(self.metrics, config.request_timeout)

    @property
    def model_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.client.model.name if self.client.model else ""

    def require_model(self) -> ModelInfo:
        """The model, or 503 while it loads / when the engine is down / while shutting down."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.client.engine_error is not None:
            raise APIError(503, f"the engine failed: {self.client.engine_error}", code="engine_error")
        model = self.client.model
        if model is None:
            raise APIError(503, "the model is still loading; retry when GET /ready answers 200",
                           code="not_ready", headers={"Retry-After": "1"})
        if not self.client.healthy:
            raise APIError(503, "the engine is not answering (scheduler or worker down)", code="engine_down")
        return model

    def require_tokenizer(self) -> ModelTokenizer:
        model = self.require_model()
        if self._tokenizer is None or self._tokenizer.info is not model:
            self._tokenizer = ModelTokenizer(model)
            return_freed_memory()  # what parsing the tokenizer's JSON freed
        return self._tokenizer

    def splits_reasoning(self, tokenizer: ModelTokenizer) -> bool:
        """Whether chat answers are split into reasoning and content (``--reasoning-parser``):
        auto splits them for a tokenizer that has ``<think>`` and ``</think>``."""
        parser = self.config.reasoning_parser
        return parser != "none" and (parser != "auto" or bool(tokenizer.think_tags))

    def is_admin(self, request: Request) -> bool:
        """Constant-time check of ``Authorization: Bearer <admin token>``."""
        token = self.config.admin_token
        if not token:
            return False
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
