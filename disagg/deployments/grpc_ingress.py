"""The DLRM ingress's OIP v2 gRPC calls as Ray Serve's gRPC proxy invokes them: a method per RPC, by its name, given
the request message and Serve's ``grpc_context``.

A refusal sets the call's status and details (``grpc_status`` of the REST error, its message) and answers the
empty response message, as Serve's gRPC guide has it. Serve routes a call to this app by the ``application``
metadata when it runs more than one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import cached_property
from typing import Any, TypeVar

from google.protobuf.message import Message

from disagg.api._proto import grpc_predict_v2_pb2 as pb
from disagg.api.grpc_service import Metadata, OIPGrpcHandlers, grpc_status
from disagg.config import DLRMAppConfig
from serving.common.constants import API_KEY
from serving.common.errors import APIError, internal_error
from serving.common.logging import get_logger

logger = get_logger("disagg.deployments.grpc_ingress")

Response = TypeVar("Response", bound=Message)


async def _answer(handler: Callable[[Any, Metadata], Awaitable[Response]], request: Message, grpc_context: Any,
                  empty: type[Response]) -> Response:
    """``handler``'s answer to ``request``; its ``APIError`` as the call's status, any other error as INTERNAL with
    the REST API's message (logged, never sent) (``grpc_context``: Serve's, or a ``grpc.aio.ServicerContext``)."""
    try:
        return await handler(request, grpc_context.invocation_metadata())
    except APIError as error:
        refusal = error
    except Exception:
        logger.exception("unhandled error in a gRPC call")
        refusal = internal_error()
    grpc_context.set_code(grpc_status(refusal))
    grpc_context.set_details(refusal.message)
    return empty()


class OIPGrpcIngress:
    """``GRPCInferenceService``'s calls on a DLRM ingress, which is the ``DLRMBackend`` they serve."""

    #: The application this replica serves.
    config: DLRMAppConfig

    @cached_property
    def _oip_grpc(self) -> OIPGrpcHandlers:
        return OIPGrpcHandlers(self, self.config, api_key=API_KEY)  # type: ignore[arg-type]

    async def ServerLive(self, request: pb.ServerLiveRequest, grpc_context: Any) -> pb.ServerLiveResponse:
        return await _answer(self._oip_grpc.server_live, request, grpc_context, pb.ServerLiveResponse)

    async def ServerReady(self, request: pb.ServerReadyRequest, grpc_context: Any) -> pb.ServerReadyResponse:
        return await _answer(self._oip_grpc.server_ready, request, grpc_context, pb.ServerReadyResponse)

    async def ModelReady(self, request: pb.ModelReadyRequest, grpc_context: Any) -> pb.ModelReadyResponse:
        return await _answer(self._oip_grpc.model_ready, request, grpc_context, pb.ModelReadyResponse)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, grpc_context: Any) -> pb.ServerMetadataResponse:
        return await _answer(self._oip_grpc.server_metadata, request, grpc_context, pb.ServerMetadataResponse)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, grpc_context: Any) -> pb.ModelMetadataResponse:
        return await _answer(self._oip_grpc.model_metadata, request, grpc_context, pb.ModelMetadataResponse)

    async def ModelInfer(self, request: pb.ModelInferRequest, grpc_context: Any) -> pb.ModelInferResponse:
        return await _answer(self._oip_grpc.model_infer, request, grpc_context, pb.ModelInferResponse)
