"""The base of both DLRM ingress deployments: the OIP v2 API, requests merged into one batch and results split back."""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from fastapi import FastAPI
from ray import serve

from disagg.api.backend import DLRMBackend
from disagg.api.server import create_oip_api
from disagg.config import BatchingConfig, DLRMAppConfig
from disagg.deployments.grpc_ingress import OIPGrpcIngress
from disagg.model_check import output_tensors
from disagg.signature import ModelSignature
from serving.common.constants import API_KEY
from serving.common.errors import APIError
from serving.common.logging import get_logger
from serving.common.memory import MemoryReport
from serving.common.metrics import NO_METRICS, Metrics

logger = get_logger("disagg.deployments.ingress")

#: One request's inputs, keyed by ``forward`` argument.
Inputs = dict[str, torch.Tensor]


class MergedBatch(NamedTuple):
    """Requests that share one forward pass: their inputs concatenated along the batch, which requests they are
    (positions in the list given to ``merge_requests``) and each one's row count, in order."""

    inputs: Inputs
    members: list[int]
    row_counts: list[int]


def merge_requests(requests: Sequence[Inputs], signature: ModelSignature) -> list[MergedBatch]:
    """Concatenates ``requests`` along the batch dimension, as few passes as their shapes allow.

    An input with a ``pad_value`` is padded to the largest size of each variable dimension (the DLRM's id bags, with
    empty slots, which leaves sum-pooled bags unchanged); requests whose other inputs differ in a variable
    dimension go to separate passes, in order of their first request.
    """
    if not requests:
        raise ValueError("cannot merge an empty list of requests")
    padded = {tensor.forward_argument for tensor in signature.inputs if tensor.pad_value is not None}
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, inputs in enumerate(requests):
        key = tuple((name, tuple(tensor.shape[1:])) for name, tensor in inputs.items() if name not in padded)
        groups.setdefault(key, []).append(index)
    pad_values = {tensor.forward_argument: tensor.pad_value for tensor in signature.inputs}
    merged = []
    for members in groups.values():
        inputs = {name: _concatenate([requests[index][name] for index in members], pad_values[name])
                  for name in requests[members[0]]}
        merged.append(MergedBatch(inputs, members, [next(iter(requests[index].values())).shape[0]
                                                    for index in members]))
    return merged


def _concatenate(tensors: list[torch.Tensor], pad_value: float | None) -> torch.Tensor:
    """``tensors`` along dimension 0, each first padded with ``pad_value`` to the largest size of every other
    dimension (only ever needed where the input has one)."""
    if len(tensors) == 1:
        return tensors[0]
    if pad_value is not None:
        sizes = torch.Size(max(sizes) for sizes in zip(*(tensor.shape[1:] for tensor in tensors), strict=True))
        tensors = [tensor if tensor.shape[1:] == sizes else
                   F.pad(tensor, [p for size, have in zip(reversed(sizes), reversed(tensor.shape[1:]), strict=True)
                                  for p in (0, size - have)], value=pad_value) for tensor in tensors]
    return torch.cat(tensors)


def split_rows(outputs: Sequence[torch.Tensor], row_counts: Sequence[int]) -> list[list[torch.Tensor]]:
    """Inverse of ``merge_requests`` for a pass's outputs: per request, in order, its rows of each output."""
    for output in outputs:
        if output.shape[0] != sum(row_counts):
            raise ValueError(f"an output has {output.shape[0]} rows but the requests hold {sum(row_counts)}")
    per_output = [torch.split(output, list(row_counts)) for output in outputs]
    return [list(parts) for parts in zip(*per_output, strict=True)]


class BatchedDLRM(DLRMBackend, MemoryReport, OIPGrpcIngress):
    """A ``DLRMBackend`` deployment, over OIP v2's REST API and its gRPC calls: concurrent requests are merged into
    one ``_forward_batch`` (``@serve.batch``); two batches may be in flight: with one torch thread a replica computes
    both at once (in worker threads), and a disaggregated one's lookups overlap the other's compute.

    Subclasses set ``signature``, ``id_ranges``, ``config`` and ``metrics`` and call ``_apply_batching`` in their
    constructor; ``reconfigure`` takes a ``BatchingConfig``-shaped Serve ``user_config`` to change batching without a
    restart.
    """

    #: The application this replica serves.
    config: DLRMAppConfig
    #: Where request latencies and batch sizes go.
    metrics: Metrics = NO_METRICS

    def __serve_build_asgi_app__(self) -> FastAPI:
        return create_oip_api(self, self.config, api_key=API_KEY)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Applies a new ``BatchingConfig`` (Ray Serve ``user_config``) to the running replica."""
        batching = BatchingConfig.model_validate(user_config)
        self._apply_batching(batching)
        logger.info("%s batching now max_batch_size=%d batch_wait_timeout_s=%g", type(self).__name__,
                    batching.max_batch_size, batching.batch_wait_timeout_s)

    def _apply_batching(self, batching: BatchingConfig) -> None:
        self._infer_batch.set_max_batch_size(batching.max_batch_size)
        self._infer_batch.set_batch_wait_timeout_s(batching.batch_wait_timeout_s)

    def ready(self) -> bool:
        return True

    async def infer(self, inputs: Inputs) -> list[torch.Tensor]:
        """One request's outputs, computed in a batch with whatever else is waiting."""
        with self.metrics.request("dlrm_infer"):
            result = await self._infer_batch(inputs)
            if isinstance(result, APIError):
                raise result
            return result

    @serve.batch(max_concurrent_batches=2)
    async def _infer_batch(self, requests: list[Inputs]) -> list[list[torch.Tensor] | APIError]:
        return await self._run_requests(requests)

    async def _run_requests(self, requests: list[Inputs]) -> list[list[torch.Tensor] | APIError]:
        """Each request's outputs, or the 400 its input earned: a ValueError the model raised (an id its own
        lookups refused) fails only the request at fault, found by running the batch's requests one by one."""
        results: list[list[torch.Tensor] | APIError] = [[] for _ in requests]
        for merged in merge_requests(requests, self.signature):
            self.metrics.dlrm_batch(sum(merged.row_counts))
            try:
                returned = await self._forward_batch(merged.inputs)
            except ValueError as exc:
                if len(merged.members) > 1:
                    for index in merged.members:
                        [results[index]] = await self._run_requests([requests[index]])
                else:
                    results[merged.members[0]] = APIError(400, f"inputs: {exc}", param="inputs",
                                                          code="invalid_value")
                continue
            outputs = [output.cpu() for output in output_tensors(returned, self.signature)]
            for index, rows in zip(merged.members, split_rows(outputs, merged.row_counts), strict=True):
                results[index] = rows
        return results

    @abc.abstractmethod
    async def _forward_batch(self, inputs: Mapping[str, torch.Tensor]) -> Any:
        """What the model's ``forward`` returns for a merged batch (keyed by argument); runs heavy work off the event
        loop."""
