"""OIP v2 over gRPC (KServe's ``inference.GRPCInferenceService``): its six calls as handlers over a ``DLRMBackend``.

Each handler answers a response message or raises the ``APIError`` the REST route would answer, with the same
message; ``grpc_status`` gives its gRPC status. As over REST, the liveness and readiness calls are open and the
others need the API key (``authorization: Bearer <key>`` metadata) when the app has one; ``ModelReady`` answers
``ready: false`` where REST answers 503. Ray Serve's gRPC proxy reaches the handlers through the DLRM ingress
(``disagg.deployments.grpc_ingress``).
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from disagg.api._proto import grpc_predict_v2_pb2 as pb
from disagg.api.backend import DLRMBackend
from disagg.api.codec import decode_infer_inputs, model_metadata
from disagg.api.grpc_codec import grpc_infer_response, parse_grpc_infer_request
from disagg.api.router import MODEL_VERSION, require_model
from disagg.api.server import server_version
from disagg.config import DLRMAppConfig
from serving.common.auth import BearerCheck
from serving.common.constants import SERVER_NAME
from serving.common.errors import APIError, body_too_large

#: gRPC metadata: (key, value) pairs, keys in lower case.
Metadata = Iterable[tuple[str, str]]

#: The gRPC status of each HTTP status the API answers with.
GRPC_STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED,
}  # fmt: skip


def grpc_status(error: APIError) -> grpc.StatusCode:
    """The gRPC status answering ``error`` (INTERNAL for a status without one of its own)."""
    return GRPC_STATUS.get(error.status_code, grpc.StatusCode.INTERNAL)


class OIPGrpcHandlers:
    """The calls of ``GRPCInferenceService`` for ``backend`` served as ``config.model_name``; ``api_key``: the key
    the guarded calls need (empty: none)."""

    def __init__(self, backend: DLRMBackend, config: DLRMAppConfig, *, api_key: str = "") -> None:
        self.backend, self.config = backend, config
        self._bearer = BearerCheck(api_key) if api_key else None

    def _authorize(self, call: str, metadata: Metadata) -> None:
        if self._bearer is None:
            return
        authorization = next((value for key, value in metadata if key == "authorization"), None)
        refusal = self._bearer.refusal(authorization, f"gRPC {call}")
        if refusal is not None:
            raise refusal

    async def server_live(self, request: pb.ServerLiveRequest, metadata: Metadata) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest, metadata: Metadata) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.backend.ready())

    async def model_ready(self, request: pb.ModelReadyRequest, metadata: Metadata) -> pb.ModelReadyResponse:
        self._authorize("ModelReady", metadata)
        require_model(self.config, request.name, request.version or None)
        return pb.ModelReadyResponse(ready=self.backend.ready())

    async def server_metadata(self, request: pb.ServerMetadataRequest,
                              metadata: Metadata) -> pb.ServerMetadataResponse:
        self._authorize("ServerMetadata", metadata)
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=server_version(), extensions=["binary_tensor_data"])

    async def model_metadata(self, request: pb.ModelMetadataRequest, metadata: Metadata) -> pb.ModelMetadataResponse:
        self._authorize("ModelMetadata", metadata)
        require_model(self.config, request.name, request.version or None)
        described = model_metadata(self.config.model_name, MODEL_VERSION, self.backend.signature)
        response = pb.ModelMetadataResponse(name=described.name, versions=described.versions,
                                            platform=described.platform)
        for tensors, field in ((described.inputs, response.inputs), (described.outputs, response.outputs)):
            for tensor in tensors:
                field.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        return response

    async def model_infer(self, request: pb.ModelInferRequest, metadata: Metadata) -> pb.ModelInferResponse:
        self._authorize("ModelInfer", metadata)
        limit = self.config.limits.max_body_bytes
        if request.ByteSize() > limit:  # as the REST API's body cap answers
            raise body_too_large(limit)
        require_model(self.config, request.model_name, request.model_version or None)
        parsed, arrays = parse_grpc_infer_request(request)
        inputs = decode_infer_inputs(parsed, self.backend.signature, self.backend.id_ranges, self.config.limits,
                                     arrays)
        outputs = await self.backend.infer(inputs)
        return grpc_infer_response(outputs, self.backend.signature, requested=parsed.outputs,
                                   model_name=self.config.model_name, model_version=MODEL_VERSION,
                                   request_id=parsed.id)
