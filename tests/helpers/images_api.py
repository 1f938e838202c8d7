"""The images API over in-process engines, or over a fake backend, as a ``TestClient``."""

import asyncio
import io
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager

from fastapi.testclient import TestClient
from PIL import Image

from serving.api.models import ServedModel, ServedModels
from serving.api.server import create_images_api
from serving.common.errors import APIError
from serving.config import DiffusionAppConfig
from serving.engine import (
    DiffusionEngine,
    GenerationEvent,
    GenerationParams,
    GenerationResult,
    ImageGenerationBackend,
    LocalBackend,
    ModelInfo,
    PartialImage,
)


@contextmanager
def images_client(engine: DiffusionEngine, config: DiffusionAppConfig, *, api_key: str = "") -> Iterator[TestClient]:
    """A ``TestClient`` of the images API over a ``LocalBackend`` of ``engine``; the backend is closed after."""
    with models_client([(engine, config)], api_key=api_key) as client:
        yield client


@contextmanager
def models_client(models: Sequence[tuple[DiffusionEngine, DiffusionAppConfig]], *,
                  api_key: str = "") -> Iterator[TestClient]:
    """A ``TestClient`` of the images API serving several models, each a ``LocalBackend`` of its engine (the first
    the default); the backends are closed after."""
    backends = [(LocalBackend.for_engine(engine, config), config) for engine, config in models]
    try:
        served = ServedModels([ServedModel(backend, config) for backend, config in backends])
        with TestClient(create_images_api(served, api_key=api_key)) as client:
            yield client
    finally:
        for backend, _ in backends:
            backend.close()


#: The fake's model: 64x64 by default, sides multiples of 8, its own scheduler ``pndm`` and two others.
FAKE_INFO = ModelInfo(name="tiny", default_size=64, size_multiple=8, schedulers=("ddim", "euler"),
                      default_scheduler="pndm")


class FakeImagesBackend(ImageGenerationBackend):
    """An engine stand-in answering at once with solid grey PNGs of the request's size (``fake_events``); it records
    each request and how each stream ended (``finished``, ``failed``, or ``closed``: closed or cancelled early).

    ``refusal``: raised before the first event (and by ``generate``); ``failure``: raised after ``fail_after``
    events; ``hold``: awaited after each event (a generation still running)."""

    def __init__(self, info: ModelInfo = FAKE_INFO) -> None:
        self.info = info
        self.loras = ["outlined"]
        self.requests: list[GenerationParams] = []
        self.ends: list[str] = []
        self.refusal: APIError | None = None
        self.fail_after: int | None = None
        self.failure: Exception = APIError(500, "the engine failed", code="engine_error")
        self.hold: asyncio.Event | None = None

    async def model_info(self) -> ModelInfo:
        return self.info

    async def list_loras(self) -> list[str]:
        return self.loras

    async def list_controlnets(self) -> list[str]:
        return []

    async def generate(self, params: GenerationParams) -> GenerationResult:
        self.requests.append(params)
        if self.refusal is not None:
            raise self.refusal
        return fake_result(params)

    async def generate_stream(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        self.requests.append(params)
        ended = "closed"
        try:
            if self.refusal is not None:
                raise self.refusal
            for sent, event in enumerate(fake_events(params)):
                if sent == self.fail_after:
                    raise self.failure
                yield event
                if self.hold is not None:
                    await self.hold.wait()
            ended = "finished"
        except Exception:
            ended = "failed"
            raise
        finally:
            self.ends.append(ended)


def solid_png(width: int, height: int, value: int) -> bytes:
    """A ``width`` x ``height`` PNG of one grey ``value``."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (value, value, value)).save(buffer, format="PNG")
    return buffer.getvalue()


def fake_result(params: GenerationParams) -> GenerationResult:
    """What the fake engine answers: image ``i`` is grey ``200 + i``."""
    return GenerationResult(images=[solid_png(params.width, params.height, 200 + index) for index in range(params.n)],
                            seed=params.seed, timings={"denoise_s": 0.01})


def fake_events(params: GenerationParams) -> Iterator[GenerationEvent]:
    """The fake engine's stream: each image's previews (preview ``p`` of image ``i`` is grey ``10 * i + p``, made
    at an evenly spaced step), then the result."""
    for index in range(params.n):
        for partial in range(params.partial_images):
            step = (partial + 1) * params.num_inference_steps // (params.partial_images + 1) or 1
            yield PartialImage(index, partial, step, solid_png(params.width, params.height, 10 * index + partial))
    yield fake_result(params)


@contextmanager
def fake_client(backend: FakeImagesBackend, config: DiffusionAppConfig, *, api_key: str = "") -> Iterator[TestClient]:
    """A ``TestClient`` of the images API over ``backend``."""
    with TestClient(create_images_api(ServedModels.one(backend, config), api_key=api_key)) as client:
        yield client
