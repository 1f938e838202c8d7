"""Streamed generations (``stream: true``): OpenAI's server-sent events over a fake backend (no engine, no Ray)."""

import asyncio
import base64
import contextlib
import io
import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent
from PIL import Image
from starlette.requests import ClientDisconnect

from serving.api.models import ServedModel, ServedModels
from serving.api.server import create_images_api
from serving.common.errors import APIError, retry_after
from serving.config import DiffusionAppConfig, GenerationDefaults, ImageLimits
from serving.engine import ModelInfo
from tests.helpers.images_api import FakeImagesBackend, fake_client

CONFIG = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=4), limits=ImageLimits(max_n=2))
#: What OpenAI's image events carry (the client's models require them), then swiftserve's extensions.
OPENAI_FIELDS = {"type", "b64_json", "created_at", "size", "quality", "background", "output_format"}
PARTIAL_FIELDS = OPENAI_FIELDS | {"partial_image_index"} | {"image_index", "step"}
COMPLETED_FIELDS = OPENAI_FIELDS | {"usage"} | {"image_index", "seed", "timings", "lora"}


@pytest.fixture
def backend() -> FakeImagesBackend:
    return FakeImagesBackend()


@pytest.fixture
def client(backend):
    with fake_client(backend, CONFIG) as test_client:
        yield test_client


def sse_events(text: str) -> list[tuple[str, dict]]:
    """``(event, data)`` of each frame of an event stream."""
    events = []
    for frame in text.split("\n\n")[:-1]:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        events.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    assert text.endswith("\n\n")
    return events


def png_size(b64: str) -> tuple[int, int]:
    return Image.open(io.BytesIO(base64.b64decode(b64))).size


def test_stream_sends_each_preview_then_one_completed_event_per_image(client, backend):
    response = client.post("/v1/images/generations", json={"prompt": "a red circle", "n": 2, "size": "32x16",
                                                           "seed": 5, "stream": True, "partial_images": 2})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    events = sse_events(response.text)
    assert [(name, data["type"]) for name, data in events] == (
        [("image_generation.partial_image",) * 2] * 4 + [("image_generation.completed",) * 2] * 2)
    partials, completed = [data for _, data in events[:4]], [data for _, data in events[4:]]
    assert [(p["image_index"], p["partial_image_index"], p["step"]) for p in partials] == [
        (0, 0, 1), (0, 1, 2), (1, 0, 1), (1, 1, 2)]
    assert all(set(p) == PARTIAL_FIELDS for p in partials)
    assert [(c["image_index"], c["seed"]) for c in completed] == [(0, 5), (1, 6)]
    for data in partials + completed:
        assert (data["size"], data["quality"], data["background"], data["output_format"]) == (
            "32x16", "auto", "opaque", "png")
        assert png_size(data["b64_json"]) == (32, 16)
        assert isinstance(data["created_at"], int)
    for data in completed:
        assert set(data) == COMPLETED_FIELDS
        assert data["usage"] == {"input_tokens": 0, "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
                                 "output_tokens": 0, "total_tokens": 0}
        assert data["timings"]["total_s"] > 0 and data["timings"]["denoise_s"] == 0.01
    assert backend.requests[0].partial_images == 2
    assert backend.ends == ["finished"]


def test_stream_without_partial_images_sends_only_the_images(client, backend):
    response = client.post("/v1/images/generations", json={"prompt": "x", "stream": True})
    assert [name for name, _ in sse_events(response.text)] == ["image_generation.completed"]
    assert backend.requests[0].partial_images == 0


def test_without_stream_the_answer_is_json(client, backend):
    response = client.post("/v1/images/generations", json={"prompt": "x", "stream": False, "partial_images": 0})
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert len(response.json()["data"]) == 1
    assert backend.ends == []  # the non-streaming path never opened a stream


@pytest.mark.parametrize(("body", "says"), [
    ({"stream": True, "partial_images": 4}, "less than or equal to 3"),
    ({"stream": True, "partial_images": -1}, "greater than or equal to 0"),
    ({"partial_images": 2}, "`stream: true`"),
    ({"stream": False, "partial_images": 1}, "`stream: true`"),
    ({"stream": "yes"}, "boolean"),
])
def test_bad_stream_fields_are_400_naming_them(client, backend, body, says):
    response = client.post("/v1/images/generations", json={"prompt": "x", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == next(iter(body.keys() - {"stream"}), "stream")
    assert says in error["message"]
    assert backend.requests == []


def test_a_refusal_before_the_first_event_is_a_json_error_with_its_status(client, backend):
    backend.refusal = APIError(503, "overloaded: retry later", code="overloaded", headers=retry_after(2))
    response = client.post("/v1/images/generations", json={"prompt": "x", "stream": True, "partial_images": 1})
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/json"
    assert response.headers["retry-after"] == "2"
    assert response.json() == {"error": {"message": "overloaded: retry later", "type": "server_error",
                                         "param": None, "code": "overloaded"}}
    assert backend.ends == ["failed"]


def test_a_lora_of_another_model_is_explained_before_the_stream_starts(backend):
    backend.refusal = APIError(404, "LoRA 'xl-style' not found", param="loras[0].name", code="lora_not_found")
    other = FakeImagesBackend(ModelInfo(name="xl", default_size=64, size_multiple=8, family="sdxl"))
    other.loras = ["xl-style"]
    xl = CONFIG.model_copy(update={"model": CONFIG.model.model_copy(update={"name": "xl"})})
    app = create_images_api(ServedModels([ServedModel(backend, CONFIG), ServedModel(other, xl)]))
    with TestClient(app) as client:
        response = client.post("/v1/images/generations", json={"prompt": "x", "stream": True,
                                                               "loras": [{"name": "xl-style"}]})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "model_mismatch"


@pytest.mark.parametrize(("failure", "error"), [
    (APIError(500, "the engine failed", code="engine_error"),
     {"message": "the engine failed", "type": "server_error", "param": None, "code": "engine_error"}),
    (APIError(503, "the ControlNet went away", code="controlnet_unavailable"),
     {"message": "the ControlNet went away", "type": "server_error", "param": None,
      "code": "controlnet_unavailable"}),
    (RuntimeError("secret internals"),
     {"message": "internal server error", "type": "server_error", "param": None, "code": "internal_error"}),
], ids=["api-error", "unavailable", "unexpected"])
def test_a_failure_mid_stream_is_an_error_event_that_ends_it(client, backend, failure, error):
    backend.fail_after, backend.failure = 1, failure
    response = client.post("/v1/images/generations", json={"prompt": "x", "stream": True, "partial_images": 2})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert [name for name, _ in events] == ["image_generation.partial_image", "error"]
    assert events[1][1] == {"type": "error", "error": error}
    assert backend.ends == ["failed"]


# --- the official client ----------------------------------------------------------------------------------------


def async_openai(backend: FakeImagesBackend) -> openai.AsyncOpenAI:
    """The official async client over the API in process (``httpx.ASGITransport``)."""
    app = create_images_api(ServedModels.one(backend, CONFIG))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://images.test")
    return openai.AsyncOpenAI(base_url="http://images.test/v1", api_key="unused", http_client=http, max_retries=0)


def test_the_official_client_parses_a_streamed_generation(backend):
    async def run() -> list:
        client = async_openai(backend)
        stream = await client.images.generate(model="tiny", prompt="a red circle", size="32x32", stream=True,
                                              partial_images=2, extra_body={"seed": 3, "scheduler": "euler"})
        return [event async for event in stream]

    events = asyncio.run(run())
    assert [type(event) for event in events] == [ImageGenPartialImageEvent] * 2 + [ImageGenCompletedEvent]
    assert [event.partial_image_index for event in events[:2]] == [0, 1]
    assert all(png_size(event.b64_json) == (32, 32) and event.size == "32x32" for event in events)
    assert events[-1].usage.total_tokens == 0 and events[-1].seed == 3  # extensions ride along as extra fields
    [params] = backend.requests
    assert (params.seed, params.scheduler, params.partial_images) == (3, "euler", 2)


def test_the_official_client_raises_the_error_event(backend):
    backend.fail_after = 1

    async def run() -> list:
        stream = await async_openai(backend).images.generate(prompt="x", stream=True, partial_images=2)
        return [event.type async for event in stream]

    with pytest.raises(openai.APIError, match="the engine failed"):
        asyncio.run(run())


# --- a client that goes away ------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_client_that_goes_away_closes_the_backend_stream(backend, spec_version):
    """ASGI 2.3 (uvicorn): the server reports ``http.disconnect`` while the generation runs, and Starlette, which
    listens for it, cancels the response; 2.4: sending the next event raises ``OSError``. Either way the backend's
    iterator is closed before it finished: its request is cancelled."""
    if spec_version == "2.3":
        backend.hold = asyncio.Event()  # never set: the generation is still running when the client goes
    app = create_images_api(ServedModels.one(backend, CONFIG))
    body = json.dumps({"prompt": "x", "stream": True, "partial_images": 2}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/images/generations", "raw_path": b"",
             "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("test", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    sent: list[dict] = []

    async def run() -> None:
        first_frame = asyncio.Event()
        requested = False

        async def receive() -> dict:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await first_frame.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            if first_frame.is_set():
                raise OSError("connection reset by peer")
            sent.append(message)
            first_frame.set() if message["type"] == "http.response.body" else None

        with contextlib.suppress(ClientDisconnect):
            await asyncio.wait_for(app(scope, receive, send), timeout=10)
        assert backend.ends == ["closed"]  # by the response, not by the event loop's shutdown

    asyncio.run(run())
    assert sent[0]["status"] == 200
    assert b"image_generation.partial_image" in sent[1]["body"]
