"""The base models one Images API serves, each behind its own backend and configuration.

A request's ``model`` picks one (the first when it names none); a name not served is a 404 listing the served ones.
A LoRA or ControlNet that the picked model does not serve but another one does is a 422 naming that model and the
family it needs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from serving.api.protocol import ModelCard
from serving.common.constants import SERVER_NAME
from serving.common.errors import APIError
from serving.config import DiffusionAppConfig
from serving.engine import ImageGenerationBackend

_NOT_FOUND = {"loras": "lora_not_found", "controlnets": "controlnet_not_found"}
_ITEM_KINDS = {"loras": "LoRA", "controlnets": "ControlNet"}


@dataclass(frozen=True)
class ServedModel:
    """One base model: the engine interface to it and its configuration (defaults, limits)."""

    backend: ImageGenerationBackend
    config: DiffusionAppConfig

    @property
    def name(self) -> str:
        return self.config.model.name

    async def items(self, field: str) -> list[str]:
        """The names of its ``loras`` or ``controlnets``."""
        return await (self.backend.list_loras() if field == "loras" else self.backend.list_controlnets())


class ServedModels:
    """The served base models by name, in the configured order."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("an Images API serves at least one model")
        self._models = {model.name: model for model in models}
        if len(self._models) != len(models):
            raise ValueError("served models must have distinct names")

    @classmethod
    def one(cls, backend: ImageGenerationBackend, config: DiffusionAppConfig) -> ServedModels:
        return cls([ServedModel(backend, config)])

    @property
    def all(self) -> list[ServedModel]:
        return list(self._models.values())

    @property
    def max_body_bytes(self) -> int:
        """The largest request body any model accepts (the app's one cap)."""
        return max(model.config.limits.max_body_bytes for model in self._models.values())

    def pick(self, name: str | None) -> ServedModel:
        """The model a request names, or the default; 404 naming the served models."""
        if name is None:
            return next(iter(self._models.values()))
        model = self._models.get(name)
        if model is None:
            served = ", ".join(repr(served) for served in self._models)
            raise APIError(404, f"model {name!r} does not exist; served models: {served}", param="model",
                           code="model_not_found")
        return model

    async def explain_missing(self, error: APIError, picked: ServedModel,
                              requested: Mapping[str, Sequence[str]]) -> APIError:
        """A 404 for a LoRA or ControlNet (``requested`` lists the request's names by field) that ``picked`` does
        not serve but another model does, as a 422 naming that model and the family it needs; else ``error``."""
        field = next((field for field, code in _NOT_FOUND.items() if code == error.code), None)
        if field is None:
            return error
        served = set(await picked.items(field))
        for index, name in enumerate(requested[field]):
            if name in served:
                continue
            for other in self._models.values():
                if other is not picked and name in await other.items(field):
                    family = (await other.backend.model_info()).family
                    mine = (await picked.backend.model_info()).family
                    return APIError(422, f"{_ITEM_KINDS[field]} {name!r} is served with model {other.name!r} and "
                                         f"needs the {family} family; model {picked.name!r} is {mine}",
                                    param=f"{field}[{index}].name", code="model_mismatch")
        return error

    async def cards(self) -> list[ModelCard]:
        """Every base model's card, then each one's ControlNets and LoRAs."""
        cards = []
        for model in self._models.values():
            info = await model.backend.model_info()
            side = info.default_size
            cards.append(ModelCard(id=info.name, owned_by=SERVER_NAME, kind="base-model", family=info.family,
                                   size=f"{side}x{side}", schedulers=list(info.schedulers) or None,
                                   default_scheduler=info.default_scheduler or None))
        for model in self._models.values():
            for field, kind in (("controlnets", "controlnet"), ("loras", "lora")):
                cards += [ModelCard(id=name, owned_by=SERVER_NAME, kind=kind, model=model.name)
                          for name in await model.items(field)]
        return cards
