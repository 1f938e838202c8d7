"""Every engine, LoRA and ControlNet refusal answers its own status, message, code, headers and request field,
through the backend's one ``except`` and across a Serve replica boundary."""

import asyncio
import pickle
from concurrent.futures import Future

import numpy as np
import pytest

from serving.common.errors import APIError, RequestItemError
from serving.controlnet.client import ControlNetNotFound, ControlNetUnavailable
from serving.engine import EngineOverloaded, GenerationParams, LocalBackend, LoRALoadFailed, LoRASpec
from serving.engine.diffusion_engine import InvalidImageSize
from serving.engine.types import ControlNetSpec
from serving.lora.registry import InvalidLoRAName, LoRANotFound

IMAGE = np.zeros((8, 8, 3), dtype=np.uint8)
REQUEST = GenerationParams(
    prompt="a red circle", width=64, height=64, num_inference_steps=2, guidance_scale=7.5, seed=1,
    loras=(LoRASpec("outlined"), LoRASpec("../etc/passwd"), LoRASpec("gone"), LoRASpec("broken")),
    controlnets=(ControlNetSpec("edges", IMAGE), ControlNetSpec("depth", IMAGE)),
)
LORA_RULE = "names are 1-128 of [A-Za-z0-9_.-], starting alphanumeric, without '..'"

#: error -> (status, message, param in REQUEST, code, headers): the answers of the engine's refusals.
ANSWERS = [
    (InvalidLoRAName("../etc/passwd"),
     (400, f"invalid LoRA name: '../etc/passwd': {LORA_RULE}", "loras[1].name", "invalid_lora_name", None)),
    (LoRANotFound("gone"), (404, "LoRA 'gone' does not exist", "loras[2].name", "lora_not_found", None)),
    (LoRALoadFailed("broken", ValueError("not a safetensors file")),
     (422, "LoRA 'broken' could not be loaded: not a safetensors file", "loras[3].name", "lora_load_failed", None)),
    (ControlNetNotFound("depth"),
     (404, "ControlNet 'depth' does not exist", "controlnets[1].name", "controlnet_not_found", None)),
    (ControlNetUnavailable("edges", TimeoutError("no answer")),
     (503, "ControlNet 'edges' is unavailable: TimeoutError: no answer", "controlnets[0].name",
      "controlnet_unavailable", {"Retry-After": "1"})),
    (EngineOverloaded.waiting(28, 7.5, 2.2),
     (503, "the model is at capacity: this request would wait 28 denoising steps (about 2.2 s) before its first, "
      "more than the 7.5 allowed", None, "overloaded", {"Retry-After": "3"})),
    (EngineOverloaded.waiting(1, 0, 0.0),
     (503, "the model is at capacity: this request would wait 1 denoising steps (about 0.0 s) before its first, "
      "more than the 0 allowed", None, "overloaded", {"Retry-After": "1"})),
    (InvalidImageSize("width and height must be multiples of 8"),
     (400, "width and height must be multiples of 8", None, "invalid_value", None)),
]
IDS = [f"{type(error).__name__}-{index}" for index, (error, _) in enumerate(ANSWERS)]


def _fields(error: APIError) -> tuple:
    return error.status_code, error.message, error.param, error.code, error.headers


class _Loop:
    """An engine loop that refuses every request with ``error``, at submission or from the request's future."""

    def __init__(self, error: Exception, *, at_submission: bool) -> None:
        self.error, self.at_submission = error, at_submission

    def submit(self, params: GenerationParams) -> Future:
        if self.at_submission:
            raise self.error
        future: Future = Future()
        future.set_exception(self.error)
        return future


@pytest.mark.parametrize("at_submission", [True, False], ids=["at-submission", "from-the-future"])
@pytest.mark.parametrize(("error", "answer"), ANSWERS, ids=IDS)
def test_the_backend_answers_each_refusal_with_its_status_message_code_headers_and_field(error, answer,
                                                                                          at_submission):
    with pytest.raises(APIError) as raised:
        asyncio.run(LocalBackend(_Loop(error, at_submission=at_submission)).generate(REQUEST))
    assert _fields(raised.value) == answer


@pytest.mark.parametrize(("error", "answer"), ANSWERS, ids=IDS)
def test_the_answer_crosses_a_replica_boundary_as_an_api_error_with_the_same_fields(error, answer):
    with pytest.raises(APIError) as raised:
        asyncio.run(LocalBackend(_Loop(error, at_submission=True)).generate(REQUEST))
    arrived = pickle.loads(pickle.dumps(raised.value))
    assert type(arrived) is APIError and _fields(arrived) == answer
    assert type(pickle.loads(pickle.dumps(error))) is APIError  # the bare engine error too


def test_an_item_the_request_does_not_name_is_answered_with_its_list():
    assert LoRANotFound("other").located(["outlined"]).param == "loras"
    assert ControlNetNotFound("depth").located(["depth", "depth"]).param == "controlnets[0].name"


def test_a_shared_error_is_located_per_request_without_changing_it():
    error = ControlNetUnavailable("edges", TimeoutError("no answer"))  # one error fails every request using it
    first, second = error.located(["edges"]), error.located(["depth", "edges"])
    assert (first.param, second.param, error.param) == ("controlnets[0].name", "controlnets[1].name", "controlnets")


def test_refusals_keep_the_python_errors_their_callers_catch():
    assert isinstance(InvalidImageSize("width and height must be multiples of 8"), ValueError)
    assert all(isinstance(error, RequestItemError) for error, (_, _, param, _, _) in ANSWERS if param)
    assert EngineOverloaded.waiting(28, 7.5, 2.2).wait_steps == 28 and LoRANotFound("gone").name == "gone"


def test_an_error_that_is_not_a_refusal_passes_through_unchanged():
    failure = RuntimeError("engine loop is stopped")
    with pytest.raises(RuntimeError) as raised:
        asyncio.run(LocalBackend(_Loop(failure, at_submission=True)).generate(REQUEST))
    assert raised.value is failure
