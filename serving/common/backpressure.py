"""How every swiftserve deployment answers a full queue, unless a Serve config sets its own."""

from ray.serve.config import BackpressureConfig

#: 503 with ``Retry-After: 1``, in each API's own error shape.
OVERLOADED = BackpressureConfig(status_code=503, retry_after_s=1)
