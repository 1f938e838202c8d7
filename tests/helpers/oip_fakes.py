"""OIP v2 test support: a fake DLRM backend whose answers are checkable, and the binary extension's client side."""

import json
from typing import Any

import numpy as np
import torch

from disagg.api.backend import DLRMBackend
from disagg.config import DLRMAppConfig, DLRMLimits
from disagg.spec import DLRMSpec, preset_spec

MAX_BODY_BYTES = 32 * 1024
MAX_ROWS = 16
MAX_IDS = 8


def app_config() -> DLRMAppConfig:
    """Model ``ctr`` with small limits, so tests reach them cheaply."""
    limits = DLRMLimits(max_body_bytes=MAX_BODY_BYTES, max_rows_per_request=MAX_ROWS, max_ids_per_feature=MAX_IDS)
    return DLRMAppConfig(model_name="ctr", limits=limits)


def expected_scores(dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """What ``FakeBackend`` answers: per row, the dense sum plus the sum of the non-empty ids."""
    ids = sparse.reshape(len(sparse), -1)
    return (dense.sum(axis=1, dtype=np.float64) + np.where(ids >= 0, ids, 0).sum(axis=1)).reshape(-1, 1)


class FakeBackend(DLRMBackend):
    """Scores rows with ``expected_scores`` and records what reached it."""

    spec: DLRMSpec = preset_spec("tiny")

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    async def infer(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        self.calls.append((dense, sparse))
        return torch.from_numpy(expected_scores(dense.numpy(), sparse.numpy())).to(torch.float32)


def binary_body(request: dict[str, Any], arrays: dict[str, np.ndarray]) -> tuple[bytes, str]:
    """Client side of the extension: ``arrays`` (by input name) go after the JSON header as raw bytes.

    Returns the body and the value of ``Inference-Header-Content-Length``.
    """
    request = json.loads(json.dumps(request))
    for tensor in request["inputs"]:
        if tensor["name"] in arrays:
            tensor.pop("data", None)
            tensor.setdefault("parameters", {})["binary_data_size"] = arrays[tensor["name"]].nbytes
    header = json.dumps(request).encode()
    raw = [arrays[tensor["name"]].tobytes() for tensor in request["inputs"] if tensor["name"] in arrays]
    return b"".join([header, *raw]), str(len(header))
