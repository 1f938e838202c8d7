"""Streaming, edits and cancellation through Serve's HTTP proxy: the official client reads the stream, and a client
that goes away frees its rows while the other requests go on."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import numpy as np
import pytest
from openai import OpenAI

from serving.common.metrics import CANCELLED_REQUESTS, REQUEST_LATENCY
from tests.helpers.images import decode_png, encode_png, square
from tests.helpers.prometheus import metric_value, scrape

pytestmark = pytest.mark.integration

DEADLINE_S = 120.0  # two metric report intervals at Ray's default, on a slow machine
DIFFUSION = {"application": "diffusion"}


def _client(base_url: str) -> OpenAI:
    return OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_official_client_streams_previews_then_the_image_it_would_get_unstreamed(base_url, http):
    options = {"num_inference_steps": 6, "seed": 11}
    stream = _client(base_url).images.generate(prompt="a red circle", size="64x64", stream=True, partial_images=2,
                                               extra_body=options)
    events = list(stream)
    assert [event.type for event in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [event.partial_image_index for event in events[:2]] == [0, 1]
    assert all(decode_png(base64.b64decode(event.b64_json)).shape == (64, 64, 3) for event in events)
    whole = http.post("/v1/images/generations", json={"prompt": "a red circle", "size": "64x64", **options})
    assert whole.status_code == 200, whole.text
    assert events[-1].b64_json == whole.json()["data"][0]["b64_json"]


def test_official_client_edits_an_image_with_a_mask_streamed(base_url):
    image = square(64)
    mask = np.zeros((64, 64, 4), np.uint8)
    mask[:, :, 3] = 255
    mask[:32, :, 3] = 0  # OpenAI's mask: transparent where the image is edited
    stream = _client(base_url).images.edit(
        image=("square.png", encode_png(image), "image/png"), mask=("mask.png", encode_png(mask), "image/png"),
        prompt="a blue sky", stream=True, partial_images=1, extra_body={"num_inference_steps": 4, "seed": 3})
    events = list(stream)
    assert [event.type for event in events] == ["image_edit.partial_image", "image_edit.completed"]
    edited = decode_png(base64.b64decode(events[-1].b64_json)).astype(int)
    assert edited.shape == (64, 64, 3)
    kept = np.abs(edited[40:, :] - image[40:, :]).mean()  # away from the mask's edge the kept half stays close
    assert kept < np.abs(edited[:24, :] - image[:24, :]).mean()


def test_client_that_goes_away_mid_stream_frees_its_rows_while_another_request_completes(base_url, http):
    stage = {**DIFFUSION, "stage": "denoising"}
    cancelled = {**DIFFUSION, "kind": "diffusion_generation", "status": "cancelled"}
    before = scrape()
    stage_before, status_before = metric_value(before, CANCELLED_REQUESTS, stage), metric_value(
        before, REQUEST_LATENCY, cancelled)
    other: dict[str, httpx.Response] = {}

    def generate_other() -> None:
        other["response"] = http.post("/v1/images/generations",
                                      json={"prompt": "a square", "size": "64x64", "num_inference_steps": 30})

    body = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 100, "partial_images": 3,
            "stream": True, "seed": 5}
    with httpx.Client(base_url=base_url, timeout=120) as client, \
            client.stream("POST", "/v1/images/generations", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        first = next(line for line in response.iter_lines() if line.startswith("data:"))
        assert json.loads(first.removeprefix("data:"))["type"] == "image_generation.partial_image"
        thread = threading.Thread(target=generate_other)
        thread.start()
    # the stream's connection is closed here, 75 of its 100 steps still to go
    thread.join(timeout=120)
    assert other["response"].status_code == 200, other["response"].text
    deadline = time.monotonic() + DEADLINE_S
    while True:
        samples = scrape()
        if (metric_value(samples, CANCELLED_REQUESTS, stage) > stage_before
                and metric_value(samples, REQUEST_LATENCY, cancelled) > status_before):
            break
        assert time.monotonic() < deadline, "the abandoned stream was not counted as cancelled while denoising"
        time.sleep(2)
