"""How the ingress answers what the model deployment's handle raises: overload, a dead replica, an API error; and
which model's handle it calls; the streaming call: its events, errors and cancellation."""

import asyncio
import base64

import pytest
from fastapi.testclient import TestClient
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from serving.api.server import create_images_api
from serving.common.errors import APIError
from serving.config import DiffusionAppConfig, ImagesAppConfig
from serving.controlnet.client import ControlNetNotFound
from serving.deployments.ingress import DeploymentBackend, served_models
from serving.engine import GenerationParams, GenerationResult, ModelInfo, PartialImage
from tests.helpers.images import encode_b64, square


class _RaisingMethod:
    def __init__(self, error: BaseException) -> None:
        self._error = error
        self.calls = 0

    def remote(self, *args):
        self.calls += 1

        async def fail():
            raise self._error

        return fail()


class _ReturningMethod:
    def __init__(self, value: object) -> None:
        self._value = value

    def remote(self, *args):
        async def answer():
            return self._value

        return answer()


class _Handle:
    def __init__(self, error: BaseException) -> None:
        self.generate = _RaisingMethod(error)


PARAMS = GenerationParams(prompt="a red circle", width=64, height=64, num_inference_steps=2, guidance_scale=7.5,
                          seed=1)


def _generate(error: BaseException) -> tuple[BaseException, int]:
    handle = _Handle(error)
    with pytest.raises(Exception) as raised:
        asyncio.run(DeploymentBackend(handle).generate(PARAMS))
    return raised.value, handle.generate.calls


@pytest.mark.parametrize(("retry_after_s", "header"), [(None, "1"), (0.2, "1"), (2.5, "3")])
def test_a_full_model_queue_is_a_503_overloaded_with_retry_after(retry_after_s, header):
    error, calls = _generate(BackPressureError(num_queued_requests=8, max_queued_requests=8,
                                               status_code=503, retry_after_s=retry_after_s))
    assert isinstance(error, APIError)
    assert (error.status_code, error.code, error.headers) == (503, "overloaded", {"Retry-After": header})
    assert calls == 1


def test_the_backpressure_status_code_of_the_serve_config_is_kept():
    error, _ = _generate(BackPressureError(num_queued_requests=1, max_queued_requests=1, status_code=429))
    assert isinstance(error, APIError) and error.status_code == 429


def test_a_replica_dying_under_the_request_is_a_503_and_is_not_retried():
    error, calls = _generate(ActorDiedError())
    assert isinstance(error, APIError)
    assert (error.status_code, error.code, error.headers) == (503, "replica_failed", {"Retry-After": "1"})
    assert calls == 1  # the request may be what killed the replica: it is not sent to another one


def test_an_api_error_raised_in_the_replica_reaches_the_client_unchanged():
    cause = APIError(400, "loras[0].name: unknown LoRA", param="loras[0].name")
    error, _ = _generate(RayTaskError("generate", "traceback", cause))
    assert error is cause or (isinstance(error, APIError) and error.param == "loras[0].name")


def test_any_other_task_error_is_not_dressed_up_as_a_client_error():
    error, _ = _generate(RayTaskError("generate", "traceback", ValueError("boom")))
    assert isinstance(error, RayTaskError) and not isinstance(error, APIError)


def test_an_api_error_the_replica_returns_is_raised_to_the_client_and_a_result_passes_through():
    refusal = APIError(503, "the model is at capacity", code="overloaded", headers={"Retry-After": "2"})
    handle = _Handle(RuntimeError("unused"))
    handle.generate = _ReturningMethod(refusal)
    with pytest.raises(APIError) as raised:
        asyncio.run(DeploymentBackend(handle).generate(PARAMS))
    assert raised.value is refusal
    handle.generate = _ReturningMethod("a result")
    assert asyncio.run(DeploymentBackend(handle).generate(PARAMS)) == "a result"


class _Generations:
    """A model replica's ``generate``: records each call; a ControlNet it does not serve is answered as the
    replica answers it (the ``APIError`` as a value)."""

    def __init__(self, controlnet: str) -> None:
        self.controlnet = controlnet
        self.calls: list[GenerationParams] = []

    def remote(self, params: GenerationParams):
        self.calls.append(params)
        unknown = [spec.name for spec in params.controlnets if spec.name != self.controlnet]
        answer = (ControlNetNotFound(unknown[0]).located([spec.name for spec in params.controlnets]) if unknown
                  else GenerationResult(images=[b"png"], seed=params.seed))
        return _ReturningMethod(answer).remote()


class _ModelHandle:
    """A ``DiffusionModel`` handle answering at once: its model's info, one ControlNet, and the generations."""

    def __init__(self, info: ModelInfo, controlnet: str) -> None:
        self.model_info = _ReturningMethod(info)
        self.list_loras = _ReturningMethod([])
        self.list_controlnets = _ReturningMethod([controlnet])
        self.generate = _Generations(controlnet)


def test_the_ingress_sends_each_request_to_the_handle_of_the_model_it_names():
    handles = [_ModelHandle(ModelInfo("tiny", 64, 8, "sd"), "edges"),
               _ModelHandle(ModelInfo("sdxl-tiny", 64, 8, "sdxl"), "edges-xl")]
    config = ImagesAppConfig(models=[DiffusionAppConfig(), DiffusionAppConfig(model={"name": "sdxl-tiny",
                                                                                     "preset": "sdxl-tiny"})])
    with TestClient(create_images_api(served_models(handles, config))) as client:
        cards = client.get("/v1/models").json()["data"]
        response = client.post("/v1/images/generations", json={"prompt": "x", "model": "sdxl-tiny", "size": "32x32"})
        mismatch = client.post("/v1/images/generations", json={"prompt": "x", "controlnets": [
            {"name": "edges-xl", "image": encode_b64(square())}]})
    assert [(card["id"], card.get("family"), card.get("model")) for card in cards] == [
        ("tiny", "sd", None), ("sdxl-tiny", "sdxl", None), ("edges", None, "tiny"), ("edges-xl", None, "sdxl-tiny")]
    assert response.status_code == 200, response.text
    assert [params.width for params in handles[1].generate.calls] == [32]
    assert len(handles[0].generate.calls) == 1  # the default model got the request naming the other's ControlNet
    assert mismatch.status_code == 422, mismatch.text
    error = mismatch.json()["error"]
    assert (error["code"], error["param"]) == ("model_mismatch", "controlnets[0].name")
    assert "served with model 'sdxl-tiny' and needs the sdxl family; model 'tiny' is sd" in error["message"]


# -- streaming ---------------------------------------------------------------------------------------


class _Stream:
    """A ``DeploymentResponseGenerator``: yields ``events`` (raising an exception among them), then, with ``hang``,
    waits forever; records ``cancel``."""

    def __init__(self, events: list[object], hang: bool = False) -> None:
        self._events = iter(events)
        self._hang = hang
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        event = next(self._events, None)
        if isinstance(event, BaseException):
            raise event
        if event is not None:
            return event
        if self._hang:
            await asyncio.Event().wait()
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


class _StreamingMethod:
    def __init__(self, stream: _Stream) -> None:
        self.stream = stream
        self.calls: list[GenerationParams] = []

    def remote(self, params: GenerationParams) -> _Stream:
        self.calls.append(params)
        return self.stream


class _StreamingHandle:
    """A ``DiffusionModel`` handle whose ``generate_stream`` answers ``stream``; records its ``options``."""

    def __init__(self, stream: _Stream) -> None:
        self.generate_stream = _StreamingMethod(stream)
        self.stream = stream
        self.options_given: list[dict] = []

    def options(self, **options) -> "_StreamingHandle":
        self.options_given.append(options)
        return self


PREVIEW = PartialImage(image_index=0, partial_index=0, step=1, png=b"preview")
RESULT = GenerationResult(images=[b"png"], seed=1)


async def _events(backend: DeploymentBackend) -> list[object]:
    return [event async for event in backend.generate_stream(PARAMS)]


def test_a_stream_passes_the_replicas_events_through_and_is_not_cancelled_when_it_ends():
    handle = _StreamingHandle(_Stream([PREVIEW, RESULT]))
    assert asyncio.run(_events(DeploymentBackend(handle))) == [PREVIEW, RESULT]
    assert (handle.options_given, handle.generate_stream.calls) == ([{"stream": True}], [PARAMS])
    assert not handle.stream.cancelled


@pytest.mark.parametrize("answer", [
    APIError(422, "LoRA 'x' could not be loaded", param="loras[0].name", code="lora_load_failed"),  # as a value
    RayTaskError("generate_stream", "traceback", APIError(400, "bad", code="invalid_value")),  # raised
])
def test_a_stream_raises_the_api_error_the_replica_answers(answer):
    handle = _StreamingHandle(_Stream([PREVIEW, answer]))
    with pytest.raises(APIError) as raised:
        asyncio.run(_events(DeploymentBackend(handle)))
    assert raised.value is (answer.cause if isinstance(answer, RayTaskError) else answer)


@pytest.mark.parametrize(("error", "code"), [
    (BackPressureError(num_queued_requests=8, max_queued_requests=8, status_code=503), "overloaded"),
    (ActorDiedError(), "replica_failed"),
])
def test_a_stream_maps_serves_backpressure_and_a_dead_replica_to_503s(error, code):
    with pytest.raises(APIError) as raised:
        asyncio.run(_events(DeploymentBackend(_StreamingHandle(_Stream([error])))))
    assert (raised.value.status_code, raised.value.code) == (503, code)


def test_leaving_a_stream_early_cancels_the_replica_call():
    closed = _StreamingHandle(_Stream([PREVIEW, RESULT]))

    async def close_after_the_first() -> None:
        stream = DeploymentBackend(closed).generate_stream(PARAMS)
        assert await anext(stream) == PREVIEW
        await stream.aclose()

    asyncio.run(close_after_the_first())
    assert closed.stream.cancelled
    waiting = _StreamingHandle(_Stream([PREVIEW], hang=True))

    async def cancel_while_waiting() -> None:
        seen = asyncio.Event()

        async def consume() -> None:
            async for _ in DeploymentBackend(waiting).generate_stream(PARAMS):
                seen.set()

        task = asyncio.create_task(consume())
        await seen.wait()
        task.cancel()  # the HTTP client went away while the replica is denoising
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_while_waiting())
    assert waiting.stream.cancelled


class _GroupMethod:
    """A ``DiffusionModelGroup`` method: records the model each call names, answers ``answers[model]``."""

    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers
        self.models: list[str] = []

    def remote(self, model: str, *args):
        self.models.append(model)
        return _ReturningMethod(self.answers[model]).remote()


class _GroupHandle:
    def __init__(self) -> None:
        infos = {"tiny": ModelInfo("tiny", 64, 8, "sd"), "sdxl-tiny": ModelInfo("sdxl-tiny", 64, 8, "sdxl")}
        self.model_info = _GroupMethod(infos)
        self.list_loras = _GroupMethod({"tiny": ["a"], "sdxl-tiny": ["b"]})
        self.list_controlnets = _GroupMethod({"tiny": [], "sdxl-tiny": []})
        self.generate = _GroupMethod({name: GenerationResult(images=[name.encode()], seed=1) for name in infos})


def test_with_shared_replicas_the_ingress_calls_the_one_group_handle_naming_the_model():
    handle = _GroupHandle()
    config = ImagesAppConfig(shared_replicas=True, models=[
        DiffusionAppConfig(), DiffusionAppConfig(model={"name": "sdxl-tiny", "preset": "sdxl-tiny"})])
    with TestClient(create_images_api(served_models([handle], config))) as client:
        cards = client.get("/v1/models").json()["data"]
        response = client.post("/v1/images/generations", json={
            "prompt": "x", "model": "sdxl-tiny", "size": "32x32", "response_format": "b64_json"})
    assert [(card["id"], card.get("model")) for card in cards] == [
        ("tiny", None), ("sdxl-tiny", None), ("a", "tiny"), ("b", "sdxl-tiny")]  # each model's own LoRAs
    assert response.status_code == 200, response.text
    assert handle.generate.models == ["sdxl-tiny"]
    assert base64.b64decode(response.json()["data"][0]["b64_json"]) == b"sdxl-tiny"  # that model's answer
