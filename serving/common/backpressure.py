"""How every swiftserve deployment answers a full queue, unless a Serve config sets its own."""

from ray.serve.config import BackpressureConfig

from serving.common.errors import APIError, retry_after

#: 503 with ``Retry-After: 1``, in each API's own error shape.
OVERLOADED = BackpressureConfig(status_code=503, retry_after_s=1)


def queue_full(retry_after_s: float = 1, status_code: int = 503) -> APIError:
    """How the Images API answers a request its model's queue has no room for: ``overloaded`` with ``Retry-After``."""
    return APIError(status_code, "the model is at capacity; retry later", code="overloaded",
                    headers=retry_after(retry_after_s))
