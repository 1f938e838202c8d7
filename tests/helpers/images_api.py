"""The images API over in-process engines, as a ``TestClient``."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from fastapi.testclient import TestClient

from serving.api.models import ServedModel, ServedModels
from serving.api.server import create_images_api
from serving.config import DiffusionAppConfig
from serving.engine import DiffusionEngine, LocalBackend


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
