"""``GET /v1/models``, ``GET /v1/models/{name}`` and ``GET /health``."""

from __future__ import annotations

from deploy.openai.models import ServedModel
from deploy.openai.protocol import OpenAIError
from deploy.openai.triton_client import TritonBackend


class OpenAIServingModels:
    """The served models as OpenAI model cards, and whether Triton has them ready."""

    def __init__(self, models: dict[str, ServedModel], backend: TritonBackend) -> None:
        self.models, self.backend = models, backend

    @staticmethod
    def card(model: ServedModel) -> dict:
        return {
            "id": model.name,
            "object": "model",
            "created": model.created,
            "owned_by": "lmforge",
            "max_model_len": model.max_model_len,
        }

    def list(self) -> dict:
        return {"object": "list", "data": [self.card(m) for m in self.models.values()]}

    def get(self, name: str) -> dict:
        """Raises: OpenAIError: 404 for a model not served."""
        if name not in self.models:
            raise OpenAIError(404, f"the model `{name}` does not exist", param="model", code="model_not_found")
        return self.card(self.models[name])

    async def check_ready(self) -> None:
        """Raises: OpenAIError: 503 when Triton does not have every served model ready."""
        ready = [await self.backend.ready(name) for name in self.models]
        if not all(ready):
            raise OpenAIError(503, "Triton is not ready", type_="server_error")
