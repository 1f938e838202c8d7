"""The multipart form of ``POST /v1/images/edits``: its files, and its text values as an ``ImageEditRequest``.

Form values are strings: they are parsed as pydantic parses strings (``"2"`` for 2, ``"true"`` for true) and
validated by the model the JSON route shares, so a bad one is the same 400 naming the field. ``image`` (or
OpenAI's array form ``image[]``, of one file) and ``mask`` are files. ``loras`` comes as one JSON string
(``[{"name": "outlined", "scale": 0.5}]``) or as the openai client sends ``extra_body={"loras": [...]}``:
``loras[][name]``, ``loras[][scale]``, each field once per LoRA, matched up by position.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import TypeAdapter, ValidationError
from starlette.datastructures import UploadFile
from starlette.requests import Request

from serving.api.protocol import ImageEditRequest, LoRARequest, invalid_field
from serving.common.errors import APIError
from serving.common.http import validation_error_to_api_error

EDITS_PATH = "/v1/images/edits"
_FILES = ("image", "mask")
#: How the openai client flattens a list of objects into form fields: ``loras[][name]``.
_FLAT_LORA = re.compile(r"^loras\[\]\[([^\[\]]+)\]$")
_LORA_LIST = TypeAdapter(list[LoRARequest])
#: More files than an edit has, so that a second image is refused by name rather than by the parser's cap.
_MAX_FILES = 16
_MAX_FIELDS = 256

FormItems = Sequence[tuple[str, UploadFile | str]]


@dataclass(frozen=True)
class EditForm:
    """An edit request's values and its files' bytes."""

    request: ImageEditRequest
    image: bytes
    mask: bytes | None


async def read_edit_form(request: Request) -> EditForm:
    """The edit in ``request``'s multipart body; 400 naming the field at fault."""
    content_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if content_type != "multipart/form-data":
        raise APIError(400, "body: send multipart/form-data, the image as a file", param="body",
                       code="invalid_value")
    async with request.form(max_files=_MAX_FILES, max_fields=_MAX_FIELDS) as form:
        items = form.multi_items()
        files = await _read_files(items)
        return EditForm(_edit_request(items), files["image"], files.get("mask"))


async def _read_files(items: FormItems) -> dict[str, bytes]:
    """The bytes of ``image`` and ``mask`` (if sent): one file each."""
    uploads: dict[str, list[UploadFile]] = {}
    for key, value in items:
        name = key.removesuffix("[]")
        if isinstance(value, UploadFile) != (name in _FILES):
            raise invalid_field(name, "must be a file" if name in _FILES else "must be a text value, not a file")
        if isinstance(value, UploadFile):
            uploads.setdefault(name, []).append(value)
    if "image" not in uploads:
        raise invalid_field("image", "field required: the image to edit, as a file")
    for name, sent in uploads.items():
        if len(sent) > 1:
            raise invalid_field(name, f"one {name} per request, got {len(sent)}")
    return {name: await sent[0].read() for name, sent in uploads.items()}


def _edit_request(items: FormItems) -> ImageEditRequest:
    """The form's text values as the request model, validated as the JSON route's body."""
    values: dict[str, str] = {}
    flat_loras: dict[str, list[str]] = {}
    for key, value in items:
        if isinstance(value, UploadFile):
            continue
        flat = _FLAT_LORA.match(key)
        if flat is not None:
            flat_loras.setdefault(flat.group(1), []).append(value)
        elif key in values:
            raise invalid_field(key, "given more than once")
        else:
            values[key] = value
    loras = _loras(values.pop("loras", None), flat_loras)
    try:
        request = ImageEditRequest.model_validate_strings(values)
    except ValidationError as error:
        raise validation_error_to_api_error(error.errors()) from None
    return request.model_copy(update={"loras": loras})


def _loras(text: str | None, flat: dict[str, list[str]]) -> list[LoRARequest]:
    """The LoRAs of a JSON string or of flattened ``loras[][<field>]`` values."""
    if text is not None and flat:
        raise invalid_field("loras", "send either a JSON string or `loras[][name]` fields, not both")
    if text is not None:
        try:
            return _LORA_LIST.validate_json(text)
        except ValidationError as error:
            if error.errors()[0]["type"] == "json_invalid":
                raise invalid_field("loras", "not valid JSON; send a JSON array of LoRAs") from None
            raise _located(error, "loras") from None
    if len({len(values) for values in flat.values()}) > 1:
        raise invalid_field("loras", "each `loras[][<field>]` must be sent once per LoRA, or the LoRA a value "
                                     "belongs to is unknown: give every LoRA the same fields, or send `loras` as a "
                                     "JSON string")
    loras = []
    for index, fields in enumerate(zip(*flat.values(), strict=True)):
        try:
            loras.append(LoRARequest.model_validate_strings(dict(zip(flat, fields, strict=True))))
        except ValidationError as error:
            raise _located(error, "loras", index) from None
    return loras


def _located(error: ValidationError, *prefix: str | int) -> APIError:
    """``error`` as a 400 naming the field at fault inside the request's ``prefix``."""
    return validation_error_to_api_error([{**item, "loc": (*prefix, *item["loc"])} for item in error.errors()])


def document_edit_form(schema: dict[str, Any]) -> None:
    """Documents the edit route's multipart body in the app's OpenAPI ``schema`` (the route reads the form itself,
    so FastAPI cannot): ``image`` and ``mask`` files beside the request model's fields, ``loras`` as JSON."""
    form = ImageEditRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.update(form.pop("$defs", {}))
    files = {"image": {"type": "string", "format": "binary", "description": "The PNG or JPEG to edit."},
             "mask": {"type": "string", "format": "binary",
                      "description": "PNG or JPEG of the image's size: with alpha, its fully transparent pixels are "
                                     "repainted; without, its white pixels. Default: no mask (the whole image)."}}
    components["ImageEditForm"] = {**form, "title": "ImageEditForm", "description": "`POST /v1/images/edits`'s "
                                   "multipart form: the files, and the text values (JSON types written as text).",
                                   "properties": {**files, **form["properties"]},
                                   "required": ["image", *form.get("required", [])]}
    schema["paths"][EDITS_PATH]["post"]["requestBody"] = {"required": True, "content": {"multipart/form-data": {
        "schema": {"$ref": "#/components/schemas/ImageEditForm"},
        "encoding": {"loras": {"contentType": "application/json"}},
    }}}
