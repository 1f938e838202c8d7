"""``POST /v1/images/edits``: OpenAI's multipart form, validated as the JSON route, into ``GenerationParams.edit``;
over a fake backend (no engine, no Ray)."""

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI
from openai.types import ImageEditCompletedEvent, ImageEditPartialImageEvent
from PIL import Image

from serving.api.models import ServedModels
from serving.api.server import create_images_api
from serving.config import DiffusionAppConfig, GenerationDefaults, ImageLimits
from serving.images import decode_mask
from tests.helpers.images import encode_b64, grey_png
from tests.helpers.images_api import FakeImagesBackend, fake_client

CONFIG = DiffusionAppConfig(defaults=GenerationDefaults(num_inference_steps=4),
                            limits=ImageLimits(max_n=2, max_side=128, max_image_bytes=64 * 1024))


def png(image: np.ndarray | Image.Image) -> bytes:
    buffer = io.BytesIO()
    (image if isinstance(image, Image.Image) else Image.fromarray(image)).save(buffer, format="PNG")
    return buffer.getvalue()


def gradient(width: int, height: int) -> np.ndarray:
    """An RGB image whose pixels differ, so a resize shows."""
    xx, yy = np.meshgrid(np.linspace(0, 255, width), np.linspace(0, 255, height))
    return np.stack([xx, yy, 255 - xx], axis=-1).astype(np.uint8)


def alpha_mask(width: int, height: int, hole: tuple[slice, slice], alpha: int = 0) -> bytes:
    """OpenAI's mask: opaque, with ``alpha`` (0: fully transparent) in ``hole``."""
    rgba = np.full((height, width, 4), 255, np.uint8)
    rgba[(*hole, 3)] = alpha
    return png(Image.fromarray(rgba, "RGBA"))


IMAGE = png(gradient(40, 24))
HOLE = (slice(8, 16), slice(16, 32))  # rows, columns


@pytest.fixture
def backend() -> FakeImagesBackend:
    return FakeImagesBackend()


@pytest.fixture
def client(backend):
    with fake_client(backend, CONFIG) as test_client:
        yield test_client


def edit(client, data: dict | list | None = None, *, image: bytes | None = IMAGE, mask: bytes | None = None,
         files: list | None = None) -> httpx.Response:
    """POSTs the form: ``data`` (a prompt unless given) and the files."""
    files = list(files or [])
    if image is not None:
        files.append(("image", ("image.png", image, "image/png")))
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    return client.post("/v1/images/edits", data={"prompt": "a red circle"} if data is None else data, files=files)


def refused(response: httpx.Response, param: str) -> str:
    """The message of a 400 naming ``param``."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert error["message"].startswith(param)
    return error["message"]


def test_an_edit_with_a_mask_reaches_the_engine_at_the_images_size(client, backend):
    response = edit(client, {"prompt": "a red circle", "seed": "4", "n": "2"}, mask=alpha_mask(40, 24, HOLE))
    assert response.status_code == 200, response.text
    assert [Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).size
            for item in response.json()["data"]] == [(40, 24)] * 2
    [params] = backend.requests
    assert (params.width, params.height, params.seed, params.n, params.prompt) == (40, 24, 4, 2, "a red circle")
    np.testing.assert_array_equal(params.edit.image, gradient(40, 24))
    expected = np.zeros((24, 40), np.uint8)
    expected[HOLE] = 255
    np.testing.assert_array_equal(params.edit.mask, expected)
    assert params.edit.strength == 1.0  # diffusers' inpainting default


def test_an_edit_without_a_mask_changes_the_whole_image_at_strength_08(client, backend):
    assert edit(client).status_code == 200
    [params] = backend.requests
    assert params.edit.mask is None and params.edit.strength == 0.8
    assert (params.controlnets, params.partial_images) == ((), 0)


@pytest.mark.parametrize(("mask", "repaint"), [
    (alpha_mask(8, 8, (slice(0, 4), slice(None))), "top"),  # OpenAI: fully transparent pixels
    (alpha_mask(8, 8, (slice(0, 4), slice(None)), alpha=1), "none"),  # nearly transparent is kept
    (png(np.repeat(np.array([255] * 4 + [0] * 4, np.uint8)[:, None], 8, axis=1)), "top"),  # diffusers: white
    (png(np.repeat(np.array([128] * 4 + [127] * 4, np.uint8)[:, None], 8, axis=1)), "top"),  # at 50% grey or above
], ids=["transparent", "translucent", "white", "grey"])
def test_mask_semantics(mask, repaint):
    expected = np.zeros((8, 8), np.uint8)
    if repaint == "top":
        expected[:4] = 255
    np.testing.assert_array_equal(decode_mask(mask, max_bytes=2**20, max_pixels=2**20), expected)


def test_the_size_field_resizes_image_and_mask(client, backend):
    response = edit(client, {"prompt": "x", "size": "64x48", "strength": "0.5"}, mask=alpha_mask(40, 24, HOLE))
    assert response.status_code == 200, response.text
    [params] = backend.requests
    assert (params.width, params.height, params.edit.strength) == (64, 48, 0.5)
    assert params.edit.image.shape == (48, 64, 3) and params.edit.mask.shape == (48, 64)
    assert set(np.unique(params.edit.mask)) == {0, 255}
    assert params.edit.mask[17:31, 27:50].min() == 255  # the hole, rows 8-16 and columns 16-32, scaled by 2 and 1.6
    assert params.edit.mask[:15].max() == params.edit.mask[33:].max() == params.edit.mask[:, :24].max() == 0


@pytest.mark.parametrize(("image_size", "expected"), [
    ((40, 24), (40, 24)),  # already fits
    ((70, 30), (64, 24)),  # rounded down to multiples of 8
    ((300, 150), (128, 64)),  # scaled down to fit limits.max_side (128)
    ((129, 20), (128, 16)),
])
def test_without_size_the_images_own_size_is_fitted_to_the_model(client, backend, image_size, expected):
    response = edit(client, image=png(gradient(*image_size)))
    assert response.status_code == 200, response.text
    assert (backend.requests[0].width, backend.requests[0].height) == expected
    assert backend.requests[0].edit.image.shape == (expected[1], expected[0], 3)


@pytest.mark.parametrize(("kwargs", "param", "says"), [
    ({"mask": alpha_mask(24, 40, HOLE)}, "mask", "mask is 24x40; it must have the image's size, 40x24"),
    ({"image": b"\x89PNG broken"}, "image", "PNG"),
    ({"image": b"GIF89a"}, "image", "not a PNG or JPEG"),
    ({"mask": b"not an image"}, "mask", "not a PNG or JPEG"),
    ({"image": grey_png(100_000, 100_000, idat=b"")}, "image", "more than 4194304 pixels"),
    ({"image": b"\x89PNG" + bytes(70_000)}, "image", "larger than 65536 bytes"),
    ({"image": png(gradient(300, 4))}, "image", "at least 8 pixels"),  # 128x1 once fitted
    ({"image": None, "mask": alpha_mask(40, 24, HOLE)}, "image", "field required"),
    ({"image": None, "mask": alpha_mask(40, 24, HOLE), "data": {"prompt": "x", "image": "aGVsbG8="}}, "image",
     "must be a file"),
    ({"files": [("image", ("b.png", IMAGE, "image/png"))]}, "image", "one image per request, got 2"),
    ({"files": [("mask", ("m.png", IMAGE, "image/png"))] * 2}, "mask", "one mask per request, got 2"),
    ({"files": [("prompt", ("p.txt", b"a prompt", "text/plain"))], "data": {}}, "prompt", "not a file"),
], ids=["mask-size", "corrupt", "gif", "mask-undecodable", "pixels", "bytes", "too-small", "no-image",
        "image-as-text", "two-images", "two-masks", "text-as-file"])
def test_bad_files_are_400_naming_them(client, backend, kwargs, param, says):
    data = kwargs.pop("data", None)
    assert says in refused(edit(client, data, **kwargs), param)
    assert backend.requests == []


def test_openais_image_array_form_takes_one_image(client, backend):
    files = [("image[]", ("a.png", IMAGE, "image/png"))]
    assert edit(client, image=None, files=files).status_code == 200
    two = [*files, ("image[]", ("b.png", IMAGE, "image/png"))]
    assert "got 2" in refused(edit(client, image=None, files=two), "image")


@pytest.mark.parametrize(("data", "param", "says"), [
    ({"prompt": "x", "n": "abc"}, "n", "valid integer"),
    ({"prompt": "x", "n": "0"}, "n", "greater than or equal to 1"),
    ({"prompt": "x", "n": "3"}, "n", "at most 2 images"),
    ({"prompt": "x", "seed": "-1"}, "seed", "greater than or equal to 0"),
    ({"prompt": "x", "num_inference_steps": "2.5"}, "num_inference_steps", "integer"),
    ({"prompt": "x", "guidance_scale": "lots"}, "guidance_scale", "number"),
    ({"prompt": "x", "strength": "0"}, "strength", "greater than 0"),
    ({"prompt": "x", "strength": "1.5"}, "strength", "less than or equal to 1"),
    ({"prompt": "x", "strength": "nan"}, "strength", "less than or equal to 1"),
    ({"prompt": "x", "stream": "maybe"}, "stream", "boolean"),
    ({"prompt": "x", "stream": "true", "partial_images": "4"}, "partial_images", "less than or equal to 3"),
    ({"prompt": "x", "partial_images": "2"}, "partial_images", "`stream: true`"),
    ({"prompt": "x", "scheduler": "karras"}, "scheduler", "choices: pndm, ddim, euler"),
    ({"prompt": "x", "size": "65x64"}, "size", "multiples of 8"),
    ({"prompt": "x", "lora_mode": "eventually"}, "lora_mode", "'async' or 'exact'"),
    ({"prompt": "x", "response_format": "url"}, "response_format", "b64_json"),
    ({"prompt": "x", "controlnets": "[]"}, "controlnets", "unknown field"),
    ({"prompt": ["a", "b"]}, "prompt", "given more than once"),
    ({"prompt": ""}, "prompt", "at least 1 character"),
    ({"n": "1"}, "prompt", "field required"),
    ({"prompt": "x", "loras": "[{\"name\": \"outlined\", \"scale\": \"1\"}]"}, "loras[0].scale", "number"),
    ({"prompt": "x", "loras": "{not json"}, "loras", "not valid JSON"),
    ({"prompt": "x", "loras": json.dumps([{"name": "a"}] * 5)}, "loras", "at most 4 LoRAs"),
    ({"prompt": "x", "loras[][name]": ["a", "b"], "loras[][scale]": "0.5"}, "loras", "once per LoRA"),
    ({"prompt": "x", "loras[][name]": ["a", "b"], "loras[][scale]": ["1", "x"]}, "loras[1].scale", "number"),
    ({"prompt": "x", "loras[][name]": "a", "loras[][weight]": "1"}, "loras[0].weight", "unknown field"),
    ({"prompt": "x", "loras[][name]": "a", "loras": "[]"}, "loras", "not both"),
], ids=lambda value: value if isinstance(value, str) and len(value) < 30 else None)
def test_form_values_are_validated_as_the_json_route_does(client, backend, data, param, says):
    assert says in refused(edit(client, data), param)
    assert backend.requests == []


def test_form_values_are_converted_to_the_engines_types(client, backend):
    data = {"prompt": "a red circle", "negative_prompt": "blue", "n": "2", "seed": "9", "num_inference_steps": "3",
            "guidance_scale": "4.5", "scheduler": "ddim", "lora_mode": "exact", "response_format": "b64_json",
            "model": "tiny", "user": "someone", "loras": json.dumps([{"name": "outlined", "scale": 0.5}])}
    assert edit(client, data).status_code == 200
    [params] = backend.requests
    assert (params.negative_prompt, params.n, params.seed, params.num_inference_steps, params.guidance_scale,
            params.scheduler, params.lora_mode) == ("blue", 2, 9, 3, 4.5, "ddim", "exact")
    assert [(lora.name, lora.scale) for lora in params.loras] == [("outlined", 0.5)]


def test_naming_the_models_own_scheduler_is_the_default(client, backend):
    assert edit(client, {"prompt": "x", "scheduler": "pndm"}).status_code == 200
    assert backend.requests[0].scheduler is None


def test_a_body_that_is_not_a_multipart_form_is_400_naming_the_body(client, backend):
    response = client.post("/v1/images/edits", json={"prompt": "x", "image": encode_b64(gradient(8, 8))})
    assert "multipart/form-data" in refused(response, "body")


def test_openapi_documents_the_multipart_form_and_the_event_stream(client):
    schema = client.get("/openapi.json").json()
    operation = schema["paths"]["/v1/images/edits"]["post"]
    body = operation["requestBody"]["content"]["multipart/form-data"]
    assert body["schema"] == {"$ref": "#/components/schemas/ImageEditForm"}
    form = schema["components"]["schemas"]["ImageEditForm"]
    assert form["required"] == ["image", "prompt"]
    assert form["properties"]["image"] == {"type": "string", "format": "binary",
                                           "description": "The PNG or JPEG to edit."}
    assert {"mask", "strength", "stream", "partial_images", "scheduler", "loras"} <= set(form["properties"])
    assert form["properties"]["loras"]["items"] == {"$ref": "#/components/schemas/LoRARequest"}
    assert "LoRARequest" in schema["components"]["schemas"]
    for path in ("/v1/images/edits", "/v1/images/generations"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert set(responses) == {"200", "400", "404", "413", "422", "503"}


def test_the_edit_route_needs_the_api_key(backend):
    with fake_client(backend, CONFIG, api_key="sk-edit") as keyed:
        response = edit(keyed)
        assert response.status_code == 401
        authorized = keyed.post("/v1/images/edits", data={"prompt": "x"}, headers={"Authorization": "Bearer sk-edit"},
                                files=[("image", ("a.png", IMAGE, "image/png"))])
        assert authorized.status_code == 200, authorized.text
    assert len(backend.requests) == 1


# --- the official client ----------------------------------------------------------------------------------------


def test_the_official_client_edits(client, backend):
    """Its ``extra_body`` goes into the form: numbers as text, ``loras`` flattened to ``loras[][name]`` and
    ``loras[][scale]`` (one of each per LoRA, matched up by position)."""
    openai_client = OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", http_client=client)
    response = openai_client.images.edit(
        image=("image.png", IMAGE, "image/png"), mask=("mask.png", alpha_mask(40, 24, HOLE), "image/png"),
        prompt="a red circle", model="tiny", n=2, size="32x32", response_format="b64_json",
        extra_body={"seed": 3, "strength": 0.6, "guidance_scale": 4.0, "scheduler": "euler",
                    "loras": [{"name": "outlined", "scale": 0.5}, {"name": "dark", "scale": -1.0}]})
    assert len(response.data) == 2
    [params] = backend.requests
    assert (params.width, params.height, params.n, params.seed, params.guidance_scale) == (32, 32, 2, 3, 4.0)
    assert (params.edit.strength, params.scheduler, params.edit.mask.shape) == (0.6, "euler", (32, 32))
    assert [(lora.name, lora.scale) for lora in params.loras] == [("outlined", 0.5), ("dark", -1.0)]


def test_the_official_async_client_parses_a_streamed_edit(backend):
    app = create_images_api(ServedModels.one(backend, CONFIG))

    async def run() -> list:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://images.test")
        client = openai.AsyncOpenAI(base_url="http://images.test/v1", api_key="unused", http_client=http)
        stream = await client.images.edit(image=("image.png", IMAGE, "image/png"), prompt="a red circle",
                                          mask=("mask.png", alpha_mask(40, 24, HOLE), "image/png"), stream=True,
                                          partial_images=1, extra_body={"seed": 8})
        return [event async for event in stream]

    events = asyncio.run(run())
    assert [type(event) for event in events] == [ImageEditPartialImageEvent, ImageEditCompletedEvent]
    assert [event.type for event in events] == ["image_edit.partial_image", "image_edit.completed"]
    assert all(event.size == "40x24" and event.output_format == "png" for event in events)
    [params] = backend.requests
    assert (params.partial_images, params.seed, params.edit.mask.max()) == (1, 8, 255)
    assert backend.ends == ["finished"]
