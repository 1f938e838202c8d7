"""OIP v2 test support: fake backends whose answers are checkable (the tiny DLRM's signature and a user model's), id
ranges built without a model, and the binary extension's client side."""

import json
from typing import Any

import numpy as np
import torch

from disagg.api.backend import DLRMBackend
from disagg.config import DLRMAppConfig, DLRMLimits
from disagg.id_ranges import IdRange
from disagg.signature import EMPTY_SLOT, SPARSE_INPUT, InputSignature, ModelSignature, OutputSignature, dlrm_signature
from disagg.spec import DLRMSpec, preset_spec

MAX_BODY_BYTES = 32 * 1024
MAX_ROWS = 16
MAX_IDS = 8
TINY = preset_spec("tiny")

#: A user model: a user id [B] and a history of item ids [B, L] in, a score [B, 1] and an embedding [B, 8] out.
USERS, ITEMS, EMBEDDING_WIDTH = 100, 50, 8
USER_SIGNATURE = ModelSignature(
    inputs=[
        InputSignature(name="user", datatype="INT64", shape=[-1]),
        InputSignature(name="history", datatype="INT64", shape=[-1, -1], argument="items", pad_value=0),
    ],
    outputs=[
        OutputSignature(name="score", datatype="FP32", shape=[-1, 1]),
        OutputSignature(name="embedding", datatype="FP32", shape=[-1, EMBEDDING_WIDTH]),
    ],
)
USER_ID_RANGES = {
    "user": IdRange(0, np.array([USERS]), np.array(["users"], dtype=object)),
    "history": IdRange(0, np.array([[ITEMS]]), np.array([["items"]], dtype=object)),
}


def app_config() -> DLRMAppConfig:
    """Model ``ctr`` with small limits, so tests reach them cheaply."""
    limits = DLRMLimits(max_body_bytes=MAX_BODY_BYTES, max_rows_per_request=MAX_ROWS, max_ids_per_feature=MAX_IDS)
    return DLRMAppConfig(model_name="ctr", limits=limits)


def dlrm_id_ranges(spec: DLRMSpec) -> dict[str, IdRange]:
    """What ``disagg.id_ranges.id_ranges`` finds in a DLRM of ``spec``: position t of ``sparse_features`` indexes
    table ``embeddings.t``, and -1 is an empty slot."""
    high = np.asarray(spec.table_sizes, dtype=np.int64).reshape(1, -1, 1)
    tables = np.array([f"embeddings.{table}" for table in range(spec.num_tables)], dtype=object).reshape(1, -1, 1)
    return {SPARSE_INPUT: IdRange(EMPTY_SLOT, high, tables)}


def expected_scores(dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
    """What ``FakeBackend`` answers: per row, the dense sum plus the sum of the non-empty ids."""
    ids = sparse.reshape(len(sparse), -1)
    return (dense.sum(axis=1, dtype=np.float64) + np.where(ids >= 0, ids, 0).sum(axis=1)).reshape(-1, 1)


def expected_user_outputs(user: np.ndarray, items: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What ``UserModelBackend`` answers: score = user + the sum of the items; embedding row = user + 0..7."""
    score = (user + items.reshape(len(items), -1).sum(axis=1)).reshape(-1, 1).astype(np.float64)
    return score, (user.reshape(-1, 1) + np.arange(EMBEDDING_WIDTH)).astype(np.float64)


class FakeBackend(DLRMBackend):
    """The tiny DLRM's signature and id ranges; scores rows with ``expected_scores`` and records what reached it."""

    signature = dlrm_signature(TINY.num_dense, TINY.num_tables)
    id_ranges = dlrm_id_ranges(TINY)

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    async def infer(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.calls.append(inputs)
        return [torch.from_numpy(expected_scores(inputs["dense"].numpy(), inputs["sparse"].numpy())).to(torch.float32)]


class FailingBackend(FakeBackend):
    """Fails every infer with an error whose text a client must never see."""

    async def infer(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        raise RuntimeError("secret internal detail")


class UserModelBackend(FakeBackend):
    """``USER_SIGNATURE``'s model: answers ``expected_user_outputs`` in float64 (the API sends its signature's FP32)."""

    signature = USER_SIGNATURE
    id_ranges = USER_ID_RANGES

    async def infer(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self.calls.append(inputs)
        return [torch.from_numpy(output) for output in expected_user_outputs(inputs["user"].numpy(),
                                                                               inputs["items"].numpy())]


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
