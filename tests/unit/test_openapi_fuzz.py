"""Schemathesis against both HTTP APIs' own OpenAPI schemas: no 5xx, and every response (status, content type,
headers, body) as documented, with auth off and with an API key (sent with every case).

Backends are real and cheap: the tiny diffusion engine on CPU behind ``LocalBackend`` (limits keep a generation
to two 64x64 images of two steps) and the trained tiny DLRM. Schemathesis parametrizes tests at collection, so
the apps are built at import; the diffusion backend is plugged in by a fixture. Cases are derandomized (the
``repeatable`` Hypothesis profile); pytest's terminal summary says how many each app got.

All of schemathesis' checks run, except ``positive_data_acceptance`` on the POST routes: a schema-valid body
there can still be refused with a 400 naming the field, for what JSON Schema cannot state (tensor data against
its shape, ids against table sizes, image bytes, size multiples, seed + n in range, duplicate LoRAs).
"""

from collections import Counter
from collections.abc import AsyncIterator, Iterator
from functools import cached_property
from typing import Any

import pytest
import schemathesis
import torch
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from disagg.api.protocol import BINARY_MEDIA_TYPE
from disagg.api.server import create_oip_api
from disagg.config import DLRMAppConfig, DLRMLimits
from disagg.model import DLRM, build_preset
from disagg.signature import dlrm_signature
from disagg.spec import preset_spec, preset_weights
from serving.api.models import ServedModels
from serving.api.server import create_images_api
from serving.config import DiffusionAppConfig, GenerationDefaults, ImageLimits, LoRAConfig
from serving.engine import (
    GenerationEvent,
    GenerationParams,
    GenerationResult,
    ImageGenerationBackend,
    LocalBackend,
    ModelInfo,
)
from tests.helpers.images import encode_png, square
from tests.helpers.lora_files import write_lora
from tests.helpers.oip_fakes import dlrm_id_ranges

API_KEY = "fuzz-key-8d1e"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
#: Fuzzing-phase cases per operation at most; schemathesis' examples and coverage phases add theirs.
MAX_EXAMPLES = 100
BODY_BYTES = 256 * 1024

IMAGES_CONFIG = DiffusionAppConfig(
    defaults=GenerationDefaults(num_inference_steps=1),
    limits=ImageLimits(max_n=2, max_steps=2, max_side=64, max_loras=2, max_controlnets=1, max_body_bytes=BODY_BYTES),
)
DLRM_CONFIG = DLRMAppConfig(
    model_name="ctr", limits=DLRMLimits(max_rows_per_request=8, max_ids_per_feature=4, max_body_bytes=BODY_BYTES)
)

#: (app, operation, status, media type) -> responses
RESPONSES: Counter[tuple[str, str, int, str]] = Counter()


class PluggedImagesBackend(ImageGenerationBackend):
    """The diffusion backend of the images apps: calls the ``LocalBackend`` that ``images_backend`` plugs in."""

    backend: LocalBackend | None = None

    async def model_info(self) -> ModelInfo:
        return await self.backend.model_info()

    async def list_loras(self) -> list[str]:
        return await self.backend.list_loras()

    async def list_controlnets(self) -> list[str]:
        return await self.backend.list_controlnets()

    async def generate(self, params: GenerationParams) -> GenerationResult:
        return await self.backend.generate(params)

    def generate_stream(self, params: GenerationParams) -> AsyncIterator[GenerationEvent]:
        return self.backend.generate_stream(params)


class TinyDLRM:
    """The trained tiny DLRM on CPU as the OIP backend (built on the first request)."""

    signature = dlrm_signature(preset_spec("tiny").num_dense, preset_spec("tiny").num_tables)
    id_ranges = dlrm_id_ranges(preset_spec("tiny"))

    @cached_property
    def model(self) -> DLRM:
        return build_preset("tiny", weights=preset_weights("tiny")).eval()

    def ready(self) -> bool:
        return True

    async def infer(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [self.model(**inputs)]


IMAGES = PluggedImagesBackend()
DLRM_BACKEND = TinyDLRM()


@pytest.fixture(scope="module")
def images_backend(tiny_engine, tmp_path_factory) -> Iterator[None]:
    """The tiny engine behind the images apps, with a LoRA directory: LoRA names go through the real registry."""
    directory = tmp_path_factory.mktemp("fuzz-loras")
    write_lora(directory / "outlined.safetensors", seed=1)
    IMAGES.backend = LocalBackend.for_engine(tiny_engine, IMAGES_CONFIG.model_copy(
        update={"lora": LoRAConfig(directory=directory)}))
    yield
    IMAGES.backend.close()
    IMAGES.backend = None


class CaseReport:
    """Adds how many cases each app got, and with which statuses, to pytest's terminal summary."""

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        for app in sorted({app for app, *_ in RESPONSES}):
            statuses: Counter[int] = Counter()
            for (name, _, status, _), count in RESPONSES.items():
                if name == app:
                    statuses[status] += count
            listed = ", ".join(f"{status}: {count}" for status, count in sorted(statuses.items()))
            terminalreporter.write_line(f"schemathesis {app}: {statuses.total()} cases ({listed})")
        terminalreporter.write_line(f"schemathesis: {RESPONSES.total()} cases in all")


@pytest.fixture(scope="module")
def report_cases(request: pytest.FixtureRequest) -> None:
    request.config.pluginmanager.register(CaseReport())


#: Operations whose drawn cases cannot succeed (image bytes drawn at random never decode): a test of their own
#: sends a success case (``test_an_edit_of_a_decodable_image_answers_as_documented``).
NO_DRAWN_SUCCESS = frozenset({"POST /v1/images/edits"})


@pytest.fixture
def answered() -> Iterator[Counter[tuple[str, int, str]]]:
    """What one operation's test item got, (operation, status, media type) -> responses, over all its cases: at its
    end, a 200 unless the operation is in ``NO_DRAWN_SUCCESS`` (so its success schema was checked), and for an
    infer operation a binary response too."""
    got: Counter[tuple[str, int, str]] = Counter()
    yield got
    for operation in {operation for operation, *_ in got}:
        statuses = {status for op, status, _ in got if op == operation}
        if operation not in NO_DRAWN_SUCCESS:
            assert 200 in statuses, f"{operation}: no case succeeded ({dict(got)})"
        if operation.endswith("/infer"):
            media = {media for op, status, media in got if op == operation and status == 200}
            assert BINARY_MEDIA_TYPE in media, f"{operation}: no binary response ({dict(got)})"


def fuzz_test(name: str, app: FastAPI, headers: dict[str, str] | None) -> Any:
    """A test sending ``app`` the cases schemathesis draws from its OpenAPI schema (an item per operation),
    ``headers`` added to each."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)

    @pytest.mark.slow
    @pytest.mark.usefixtures("images_backend", "report_cases")
    # a shared, busy machine; ``answered`` is meant to gather every case of the item
    @settings(max_examples=MAX_EXAMPLES,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @schema.parametrize()
    def test(case: schemathesis.Case, answered: Counter[tuple[str, int, str]]) -> None:
        excluded = [positive_data_acceptance] if case.method == "POST" else []
        response = case.call_and_validate(headers=headers, excluded_checks=excluded)
        media_type = response.headers.get("content-type", [""])[0].split(";")[0]
        RESPONSES[name, case.operation.label, response.status_code, media_type] += 1
        answered[case.operation.label, response.status_code, media_type] += 1

    return test


APPS = {
    "images": (create_images_api(ServedModels.one(IMAGES, IMAGES_CONFIG)), None),
    "images+key": (create_images_api(ServedModels.one(IMAGES, IMAGES_CONFIG), api_key=API_KEY), AUTH),
    "oip": (create_oip_api(DLRM_BACKEND, DLRM_CONFIG), None),
    "oip+key": (create_oip_api(DLRM_BACKEND, DLRM_CONFIG, api_key=API_KEY), AUTH),
}
test_images_api = fuzz_test("images", *APPS["images"])
test_images_api_with_key = fuzz_test("images+key", *APPS["images+key"])
test_oip_api = fuzz_test("oip", *APPS["oip"])
test_oip_api_with_key = fuzz_test("oip+key", *APPS["oip+key"])


@pytest.mark.slow
@pytest.mark.usefixtures("images_backend")
@pytest.mark.parametrize("name", ["images", "images+key"])
def test_an_edit_of_a_decodable_image_answers_as_documented(name: str) -> None:
    """The edit route's success, as its schema documents it: drawn image bytes never decode as PNG, so this case
    sends one (schemathesis' checks otherwise as above)."""
    app, headers = APPS[name]
    operation = schemathesis.openapi.from_asgi("/openapi.json", app)["/v1/images/edits"]["POST"]
    case = operation.Case(body={"image": encode_png(square(64)), "prompt": "a square", "size": "64x64",
                                "num_inference_steps": "2"},
                          media_type="multipart/form-data")
    response = case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])
    assert response.status_code == 200, response.text
    assert case.operation.label in NO_DRAWN_SUCCESS
    RESPONSES[name, case.operation.label, response.status_code, "application/json"] += 1
