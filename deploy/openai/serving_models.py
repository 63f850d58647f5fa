"""``GET /v1/models``, ``GET /v1/models/{name}``, ``GET /health`` and the LoRA adapter routes
(``POST /v1/load_lora_adapter``, ``POST /v1/unload_lora_adapter``, vLLM's bodies and answers).

An adapter is served as a model of its own name whose card names its base in ``parent`` (and its
directory in ``root``), as vLLM lists them. Loading one checks it against the base
(``engine.lora.load_adapter``: files, settings, shapes, rank) and writes it into the base's
``multi_lora.json`` (``deploy.lora_adapters``), where the Triton model finds it; unloading removes it
there (requests already running finish on its weights; new ones get 404).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from pydantic import ValidationError

from deploy.lora_adapters import check_adapter_name, write_runtime_adapters
from deploy.openai.models import ServedModel, model_card
from deploy.openai.protocol import LoadLoRAAdapterRequest, OpenAIError, UnloadLoRAAdapterRequest, validation_error
from deploy.openai.triton_client import TritonBackend


class OpenAIServingModels:
    """The served models (and their adapters) as OpenAI model cards, and whether Triton has them ready."""

    def __init__(self, models: dict[str, ServedModel], backend: TritonBackend, other_names: Iterable[str] = ()) -> None:
        """``other_names``: the other models the API serves (the encoders), whose names no adapter may take."""
        self.models, self.backend = models, backend
        self.other_names = frozenset(other_names)

    @staticmethod
    def card(model: ServedModel) -> dict:
        return model_card(model.name, model.created, model.checkpoint, None, model.max_model_len)

    @staticmethod
    def adapter_card(model: ServedModel, name: str) -> dict:
        created = model.adapter_created.get(name, model.created)
        return model_card(name, created, model.adapters[name], model.name, model.max_model_len)

    def list(self) -> dict:
        cards = []
        for model in self.models.values():
            cards.append(self.card(model))
            cards += [self.adapter_card(model, name) for name in sorted(model.adapters)]
        return {"object": "list", "data": cards}

    def get(self, name: str) -> dict:
        """Raises: OpenAIError: 404 for a model or adapter not served."""
        if name in self.models:
            return self.card(self.models[name])
        base = self.base_of(name)
        if base is None:
            raise OpenAIError(404, f"the model `{name}` does not exist", param="model", code="model_not_found")
        return self.adapter_card(base, name)

    def base_of(self, adapter: str) -> ServedModel | None:
        """The model serving adapter ``adapter``, ``None`` when none does."""
        return next((m for m in self.models.values() if adapter in m.adapters), None)

    async def check_ready(self) -> None:
        """Raises: OpenAIError: 503 when Triton does not have every served model ready."""
        ready = [await self.backend.ready(name) for name in self.models]
        if not all(ready):
            raise OpenAIError(503, "Triton is not ready", type_="server_error")

    # ---------------------------------------------------------------- LoRA adapters

    def load_lora_adapter(self, body: bytes) -> str:
        """Serve a LoRA adapter from now on; returns vLLM's success text.

        Raises:
            OpenAIError: 400 a bad body or name, a name already served, a base without LoRA, or an adapter
                that does not fit the base (the message names the field); 404 an unknown ``base_model_name``.
        """
        try:
            request = LoadLoRAAdapterRequest.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        name = _adapter_name(request.lora_name)
        model = self._base_for_load(request.base_model_name)
        if name in self.models or name in self.other_names:
            raise OpenAIError(400, f"lora_name={name!r} is the name of a served model; pick another", param="lora_name")
        current = self.base_of(name)
        if current is not None and not request.load_inplace:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if current is not None and (current is not model or name in model.declared_adapters):
            raise OpenAIError(
                400, f"lora_name={name!r} is served by {current.name} as declared at export; pick another name"
            )
        path = Path(request.lora_path).expanduser()
        _check_adapter(model, name, path)
        runtime = {n: p for n, p in model.adapters.items() if n not in model.declared_adapters}
        runtime[name] = path.resolve()
        write_runtime_adapters(model.version_dir, runtime)
        model.adapters[name] = path.resolve()
        model.adapter_created[name] = int(time.time())
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload_lora_adapter(self, body: bytes) -> str:
        """Stop serving a run-time adapter; returns vLLM's success text. Its running requests finish.

        Raises:
            OpenAIError: 400 a bad body or an adapter declared at export; 404 an adapter not served.
        """
        try:
            request = UnloadLoRAAdapterRequest.model_validate_json(body)
        except ValidationError as exc:
            raise validation_error(exc) from exc
        name = request.lora_name
        model = self.base_of(name)
        if model is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        if name in model.declared_adapters:
            raise OpenAIError(
                400,
                f"lora_name={name!r} was declared at export (model.json of {model.name}); re-export the model without "
                "it to stop serving it",
                param="lora_name",
            )
        runtime = {n: p for n, p in model.adapters.items() if n not in model.declared_adapters and n != name}
        write_runtime_adapters(model.version_dir, runtime)
        del model.adapters[name]
        model.adapter_created.pop(name, None)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _base_for_load(self, base_model_name: str | None) -> ServedModel:
        if base_model_name is not None:
            model = self.models.get(base_model_name)
            if model is None:
                raise OpenAIError(
                    404,
                    f"base_model_name={base_model_name!r}: no such model; served: {sorted(self.models)}",
                    param="base_model_name",
                    code="model_not_found",
                )
        elif len(self.models) == 1:
            model = next(iter(self.models.values()))
        else:
            raise OpenAIError(
                400,
                f"base_model_name: several models are served ({sorted(self.models)}); name the adapter's base",
                param="base_model_name",
            )
        if not model.lora_enabled or model.version_dir is None:
            raise OpenAIError(
                400,
                f"model {model.name} runs without LoRA; export it with `lmforge export --enable-lora` (and "
                "--max-loras, --max-lora-rank)",
                param="base_model_name",
            )
        return model


def check_unique_names(models: dict[str, ServedModel], other_names: Iterable[str] = ()) -> None:
    """Refuse to serve an adapter named as a model or as another model's adapter (one left in an older
    ``multi_lora.json``, say): a request's ``model`` could not tell them apart.

    Raises:
        ValueError: names the adapter, what else holds its name, and the fix.
    """
    holder = {name: "a served model" for name in [*models, *other_names]}
    for model in models.values():
        for adapter in sorted(model.adapters):
            if adapter in holder:
                where = (
                    "its export (--lora)"
                    if adapter in model.declared_adapters
                    else f"{model.version_dir}/multi_lora.json"
                )
                raise ValueError(
                    f"adapter {adapter!r} of {model.name} has the name of {holder[adapter]}; "
                    f"rename or remove it in {where}"
                )
            holder[adapter] = f"an adapter of {model.name}"


def _adapter_name(name: str) -> str:
    try:
        return check_adapter_name(name)
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="lora_name") from exc


def _check_adapter(model: ServedModel, name: str, path: Path) -> None:
    """The engine's checks of an adapter against the base (files, settings, shapes, ``max_lora_rank``) -> 400."""
    # torch-heavy: imported on use, so importing this module stays light
    import torch

    from engine.checkpoint.model_spec import ModelSpec
    from engine.config import EngineConfig
    from engine.lora import LoRARequest, load_adapter

    max_lora_rank = model.engine.get("max_lora_rank", EngineConfig.max_lora_rank)
    try:
        load_adapter(
            LoRARequest(name, 1, str(path)), ModelSpec.from_checkpoint(model.checkpoint), max_lora_rank, torch.float32
        )
    except ValueError as exc:
        raise OpenAIError(400, str(exc), param="lora_path") from exc
