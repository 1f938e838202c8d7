"""How the ingress answers what the model deployment's handle raises: overload, a dead replica, an API error."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError
from ray.serve.exceptions import BackPressureError

from serving.common.errors import APIError
from serving.deployments.ingress import DeploymentBackend
from serving.engine import GenerationParams


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
