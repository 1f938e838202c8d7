"""The images API over an in-process engine, as a ``TestClient``."""

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi.testclient import TestClient

from serving.api.server import create_images_api
from serving.config import DiffusionAppConfig
from serving.engine import DiffusionEngine, LocalBackend


@contextmanager
def images_client(engine: DiffusionEngine, config: DiffusionAppConfig, *, api_key: str = "") -> Iterator[TestClient]:
    """A ``TestClient`` of the images API over a ``LocalBackend`` of ``engine``; the backend is closed after."""
    backend = LocalBackend.for_engine(engine, config)
    try:
        with TestClient(create_images_api(backend, config, api_key=api_key)) as client:
            yield client
    finally:
        backend.close()
