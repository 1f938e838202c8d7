"""Locust users of the two applications: ``DiffusionUser`` (image generations with a Zipf mix of ControlNets and
LoRAs, as in production traces) and ``DLRMUser`` (OIP v2 infer batches of synthetic rows: Criteo-shaped for a
preset, of the model's signature for a factory model).

Every user draws from its own generator seeded with ``--seed`` and its number, so its request sequence is
reproducible; loadtests/README.md, "Users", describes what each sends and checks.
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools
import json
import random
import struct
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, ClassVar

from dlrm_requests import output_problem, settings_target
from locust import HttpUser, task
from locust.clients import ResponseContextManager
from PIL import Image, ImageDraw
from settings import Settings

PROMPTS = (
    "a red circle on a white background",
    "a blue square in the middle",
    "a green triangle, flat colours",
    "a yellow star on black",
    "two small spheres side by side",
    "a wooden cube on a table",
)
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_user_numbers = itertools.count()


def zipf_weights(count: int, s: float) -> list[float]:
    """Weight of popularity ranks 1..count: r^-s."""
    return [rank ** -s for rank in range(1, count + 1)]


def zipf_pick(rng: random.Random, names: Sequence[str], k: int, s: float) -> list[str]:
    """``k`` distinct names (at most all of them), drawn one after another by Zipf weight over their rank."""
    pool, weights = list(names), zipf_weights(len(names), s)
    picked = []
    for _ in range(min(k, len(pool))):
        index = rng.choices(range(len(pool)), weights)[0]
        picked.append(pool.pop(index))
        weights.pop(index)
    return picked


@lru_cache(maxsize=8)
def control_image(width: int, height: int) -> str:
    """Base64 PNG of an edge map: the outline of a white rectangle on black, at the output size."""
    image = Image.new("RGB", (width, height))
    ImageDraw.Draw(image).rectangle((width // 4, height // 4, 3 * width // 4, 3 * height // 4), outline="white")
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk; None when ``data`` is not a PNG."""
    if len(data) < 24 or not data.startswith(_PNG_SIGNATURE) or data[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", data[16:24])


def error_text(response: Any, limit: int = 300) -> str:
    """``HTTP <status>: <message>`` from an OpenAI (``{"error": {"message"}}``) or KServe (``{"error"}``) body."""
    try:
        error = response.json().get("error")
        message = error.get("message", error) if isinstance(error, dict) else error
    except (ValueError, AttributeError):
        message = None
    if not message:
        message = response.text or getattr(response, "error", None) or "no body"
    return f"HTTP {response.status_code}: {str(message)[:limit]}"


class SwiftUser(HttpUser):
    """What both users share: settings, a seeded generator, think time, auth header, timeout."""

    abstract = True
    kind: ClassVar[str]

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.settings = Settings.from_options(environment.parsed_options)
        self.number = next(_user_numbers)
        self.rng = random.Random(f"{self.kind}:{self.settings.seed}:{self.number}")
        self.waits = random.Random(f"wait:{self.kind}:{self.settings.seed}:{self.number}")
        self.headers = {"content-type": "application/json"}
        if self.settings.api_key:
            self.headers["authorization"] = f"Bearer {self.settings.api_key}"

    def wait_time(self) -> float:
        return self.waits.uniform(self.settings.min_wait, max(self.settings.min_wait, self.settings.max_wait))

    def post(self, path: str, body: bytes) -> ResponseContextManager:
        return self.client.post(path, data=body, headers=self.headers, name=path, catch_response=True,
                                timeout=self.settings.request_timeout)

    def send(self, path: str, body: bytes) -> None:
        """POST ``body`` and mark the request failed with the reason ``check`` gives, or succeeded."""
        with self.post(path, body) as response:
            problem = self.check(response)
            if problem:
                response.failure(problem)
            else:
                response.success()

    def check(self, response: Any) -> str | None:
        """Why ``response`` is not a good answer, or None."""
        raise NotImplementedError


class DiffusionUser(SwiftUser):
    """Image generations: small, few steps, seeded; add-ons by Zipf popularity."""

    kind = "diffusion"

    def on_start(self) -> None:
        settings = self.settings
        self.path = f"{settings.diffusion_prefix.rstrip('/')}/v1/images/generations"
        self.width, self.height = (int(side) for side in settings.diffusion_size.split("x"))
        self.controlnets, self.loras = settings.controlnets, settings.loras
        if "*" in (self.controlnets + self.loras):
            served = self._served_addons()
            self.controlnets = served["controlnet"] if self.controlnets == ("*",) else self.controlnets
            self.loras = served["lora"] if self.loras == ("*",) else self.loras

    def _served_addons(self) -> dict[str, tuple[str, ...]]:
        """ControlNet and LoRA names that ``GET /v1/models`` lists for the model the requests go to (``--diffusion-
        model``, else the first base model listed: the default), alphabetical (their popularity ranks)."""
        path = f"{self.settings.diffusion_prefix.rstrip('/')}/v1/models"
        served: dict[str, list[str]] = {"controlnet": [], "lora": []}
        with self.client.get(path, headers=self.headers, name=path, catch_response=True,
                             timeout=self.settings.request_timeout) as response:
            if response.status_code != 200:
                response.failure(error_text(response))
            else:
                cards = response.json().get("data", [])
                bases = [card["id"] for card in cards if card.get("kind") == "base-model"]
                model = self.settings.diffusion_model or next(iter(bases), None)
                for card in cards:
                    if card.get("model") in (None, model):
                        served.get(card.get("kind"), []).append(card["id"])
        return {kind: tuple(sorted(items)) for kind, items in served.items()}

    def request_body(self) -> dict[str, Any]:
        settings, rng = self.settings, self.rng
        body: dict[str, Any] = {
            "prompt": rng.choice(PROMPTS),
            "n": settings.diffusion_n,
            "size": settings.diffusion_size,
            "num_inference_steps": settings.diffusion_steps,
            "seed": rng.randrange(2**31),
        }
        if settings.diffusion_model:
            body["model"] = settings.diffusion_model
        controlnets = zipf_pick(rng, self.controlnets, rng.randint(*settings.controlnets_per_request), settings.zipf_s)
        if controlnets:
            image = control_image(self.width, self.height)
            body["controlnets"] = [
                {"name": name, "image": image, "conditioning_scale": 1.0}
                | ({"preprocess": "canny"} if settings.controlnet_preprocess == "canny" else {})
                for name in controlnets
            ]
        loras = zipf_pick(rng, self.loras, rng.randint(*settings.loras_per_request), settings.zipf_s)
        if loras:
            body["loras"] = [{"name": name, "scale": settings.lora_scale} for name in loras]
        return body

    @task
    def generate(self) -> None:
        self.send(self.path, json.dumps(self.request_body()).encode())

    def check(self, response: Any) -> str | None:
        """Why ``response`` is not ``n`` PNGs of the requested size, or None."""
        if response.status_code != 200:
            return error_text(response)
        try:
            data = response.json()["data"]
            images = [base64.b64decode(item["b64_json"], validate=True) for item in data]
        except (ValueError, KeyError, TypeError, binascii.Error) as exc:
            return f"malformed images response: {exc!r}"
        if len(images) != self.settings.diffusion_n:
            return f"expected {self.settings.diffusion_n} images, got {len(images)}"
        for index, image in enumerate(images):
            if png_size(image) != (self.width, self.height):
                return f"data[{index}] is not a {self.width}x{self.height} PNG (got {png_size(image)})"
        return None


class DLRMUser(SwiftUser):
    """Recommendation infer requests; the response must hold the model's outputs for every row."""

    kind = "dlrm"

    def on_start(self) -> None:
        self.target = settings_target(self.settings, self.settings.seed + self.number)
        self.sent = 0

    @task
    def infer(self) -> None:
        self.sent += 1
        self.send(self.target.path, self.target.workload.body(self.sent - 1))

    def check(self, response: Any) -> str | None:
        """Why ``response`` does not hold each of the model's outputs for the request's rows, or None."""
        if response.status_code != 200:
            return error_text(response)
        try:
            outputs = {output["name"]: output for output in response.json()["outputs"]}
            problems = (output_problem(outputs[expected.name], expected, self.settings.dlrm_rows,
                                       self.target.probabilities) for expected in self.target.outputs)
            return next((problem for problem in problems if problem), None)
        except (ValueError, KeyError, TypeError) as exc:
            return f"malformed infer response: {exc!r}"
