"""The DLRM app's OIP v2 HTTP API: a FastAPI app over a ``DLRMBackend``, documented for the signature it serves.

Infer bodies are JSON or use the binary tensor data extension, so infer routes parse the raw body and the app
publishes the ``InferRequest`` schema itself.
"""

from __future__ import annotations

from importlib import metadata as package_metadata
from typing import Any

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic.json_schema import models_json_schema

from disagg.api.backend import DLRMBackend
from disagg.api.codec import encode_infer_request
from disagg.api.protocol import BINARY_MEDIA_TYPE, HEADER_LENGTH, ErrorResponse, InferRequest, ServerMetadata
from disagg.api.router import MODEL_VERSION, get_server_metadata, health_router, router
from disagg.config import DLRMAppConfig
from disagg.id_ranges import probe_shape, torch_dtype
from disagg.signature import InputSignature, ModelSignature, OutputSignature
from serving.common.auth import api_key_dependencies
from serving.common.constants import SERVER_NAME
from serving.common.errors import APIError
from serving.common.http import edit_openapi, error_responses, install_error_handling

_SCHEMA_REF = "#/components/schemas/{model}"


def render_oip_error(error: APIError) -> JSONResponse:
    """Errors in OIP shape: ``{"error": "<message>"}``."""
    body = ErrorResponse(error=error.message)
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


def server_version() -> str:
    """The installed swiftserve's version ("unknown" in a source tree that is not installed)."""
    try:
        return package_metadata.version("swiftserve")
    except package_metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def _infer_request_body(signature: ModelSignature) -> dict[str, Any]:
    """The infer routes' body in OpenAPI, with examples that work on a model of ``signature`` (one row of zeros,
    size 1 along its variable dimensions)."""
    zeros = {tensor.name: torch.zeros(probe_shape(tensor, batch=1, variable=1), dtype=torch_dtype(tensor.datatype))
             for tensor in signature.inputs}
    row = encode_infer_request(zeros, request_id="example").model_dump(exclude_none=True)
    examples = {
        "one_row": {"summary": "One row; JSON outputs", "value": row},
        "binary_outputs": {
            "summary": f"One row; outputs as binary data ({BINARY_MEDIA_TYPE} response)",
            "value": row | {"parameters": {"binary_data_output": True}},
        },
    }
    body_schema = {"$ref": _SCHEMA_REF.format(model=InferRequest.__name__)}
    return {
        "required": True,
        "content": {
            "application/json": {"schema": body_schema, "examples": examples},
            BINARY_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}},
        },
    }


def _tensor_line(tensor: InputSignature | OutputSignature) -> str:
    takes_int32 = isinstance(tensor, InputSignature) and tensor.datatype == "INT64"
    return f"- `{tensor.name}`: {tensor.datatype}{' (or INT32)' if takes_int32 else ''} {tensor.shape}"


def _signature_text(signature: ModelSignature) -> str:
    """The served tensors, as the infer routes' description lists them."""
    inputs = "\n".join(_tensor_line(tensor) for tensor in signature.inputs)
    outputs = "\n".join(_tensor_line(tensor) for tensor in signature.outputs)
    return f"\n\nInputs of the served model:\n\n{inputs}\n\nOutputs:\n\n{outputs}"


def _document_served_model(schema: dict[str, Any], config: DLRMAppConfig, signature: ModelSignature) -> None:
    """What the routes cannot declare: the served model's name and version as the only path values, its inputs and
    outputs, the infer body (header, examples) and the ``InferRequest`` schema as requests see it."""
    served = {"model_name": [config.model_name], "model_version": [MODEL_VERSION]}
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            for parameter in operation.get("parameters", []):
                if parameter["name"] in served:
                    parameter["schema"]["enum"] = served[parameter["name"]]
            if path.endswith("/infer"):
                operation["parameters"].append({
                    "name": HEADER_LENGTH,
                    "in": "header",
                    "required": False,
                    "description": "Binary tensor data extension: bytes of JSON at the start of the body.",
                    "schema": {"type": "string", "pattern": "^[0-9]+$"},
                })
                operation["description"] += _signature_text(signature)
                operation["requestBody"] = _infer_request_body(signature)
    _, definitions = models_json_schema([(InferRequest, "validation")], ref_template=_SCHEMA_REF)
    schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions["$defs"])


def create_oip_api(backend: DLRMBackend, config: DLRMAppConfig, *, api_key: str = "") -> FastAPI:
    """FastAPI app serving ``backend`` as model ``config.model_name`` over OIP v2, behind ``serving.common.auth``
    when ``api_key`` is non-empty (deployments pass ``constants.API_KEY``)."""
    app = FastAPI(title=f"{SERVER_NAME} DLRM (Open Inference Protocol v2)", version=server_version())
    app.state.backend = backend
    app.state.config = config
    install_error_handling(app, render_oip_error, max_body_bytes=config.limits.max_body_bytes)
    protected = api_key_dependencies(api_key)
    unauthorized = error_responses(ErrorResponse, 401) if api_key else None
    app.include_router(router, dependencies=protected, responses=unauthorized)
    app.include_router(health_router)
    # `GET /v2` under Serve's route prefix /v2: an empty path, which an included router cannot hold
    app.add_api_route("", get_server_metadata, response_model=ServerMetadata, include_in_schema=False,
                      dependencies=protected)
    edit_openapi(app, lambda schema: _document_served_model(schema, config, backend.signature))
    return app
