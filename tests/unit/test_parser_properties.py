"""Property-based tests (Hypothesis) of every parser of untrusted input.

Each parser either returns exactly what was encoded or refuses with its own documented error, whose message
names the field at fault; no other exception may escape, whatever the input:

* OIP v2 JSON tensors and binary tensor data (``disagg.api.codec``): ``ValidationError`` / ``APIError``;
* base64 conditioning images (``serving.controlnet.conditioning``): ``ConditioningImageError``;
* LoRA names (``serving.lora.registry``): ``InvalidLoRAName`` / ``LoRANotFound``;
* LoRA files (``serving.lora.format``): ``LoRAFormatError``;
* autoconfig search spaces (``autoconfig.space``): ``SpaceError``.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import string
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from PIL import Image
from pydantic import ValidationError
from safetensors.torch import save_file

from autoconfig.space import KNOB_NAMES, SearchSpace, SpaceError
from disagg.api.codec import (
    WIRE_DTYPES,
    BinaryOutputs,
    decode_infer_inputs,
    encode_infer_request,
    encode_infer_response,
    parse_infer_request,
)
from disagg.api.protocol import BINARY_DATA_SIZE, HEADER_LENGTH, InferRequest, InferResponse, InferTensor
from disagg.config import DLRMLimits
from disagg.signature import dlrm_signature
from disagg.spec import preset_spec
from serving.common.errors import APIError
from serving.controlnet.conditioning import ConditioningImageError, decode_image
from serving.lora import InvalidLoRAName, LoRAFormatError, LoRANotFound, LoRARegistry, LoRATargets, load_lora_file
from serving.lora.registry import is_valid_name
from serving.presets import build_preset
from tests.helpers.oip_fakes import ITEMS, USER_ID_RANGES, USER_SIGNATURE, USERS, dlrm_id_ranges

# No example database: runs stay independent (Hypothesis still keeps its self-gitignored .hypothesis/ cache).
BASE = settings(deadline=None, database=None)
SLOW = settings(BASE, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

SPEC = preset_spec("tiny")
SIGNATURE = dlrm_signature(SPEC.num_dense, SPEC.num_tables)
ID_RANGES = dlrm_id_ranges(SPEC)
LIMITS = DLRMLimits(max_rows_per_request=8, max_ids_per_feature=4)
DATATYPES = ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
             "BYTES")
HUGE_INTS = (10**400, -(10**400), 2**1024, 2**64, -(2**63) - 1)


def fresh_dir(tmp_path: Path) -> Path:
    """A new empty directory per Hypothesis example (``tmp_path`` is shared by all examples of a test)."""
    return Path(tempfile.mkdtemp(dir=tmp_path))


# --- JSON-like garbage -------------------------------------------------------------------------------------------

SCALARS = (st.none() | st.booleans() | st.integers() | st.sampled_from(HUGE_INTS) | st.floats()
           | st.text(max_size=12))


def json_like(keys: st.SearchStrategy[str], scalars: st.SearchStrategy[Any] = SCALARS) -> st.SearchStrategy[Any]:
    """Nested dicts/lists of scalars; dict keys are mostly names the parser knows, so parsing gets deep."""
    return st.recursive(
        scalars,
        lambda children: st.lists(children, max_size=5) | st.dictionaries(keys | st.text(max_size=8), children,
                                                                           max_size=5),
        max_leaves=25,
    )


def paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a nested dict/list value, the root () included."""
    found = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            found += paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            found += paths(child, (*prefix, index))
    return found


def mutated(data: st.DataObject, value: Any, garbage: st.SearchStrategy[Any]) -> Any:
    """``value`` (a JSON-like document) with one subtree replaced by garbage, or deleted from its container."""
    value = json.loads(json.dumps(value))
    # every key, and the first few elements of each list (tensor data would otherwise crowd out the structure)
    structural = [path for path in paths(value) if not any(isinstance(key, int) and key > 2 for key in path)]
    path = data.draw(st.sampled_from(structural), label="path")
    replacement = data.draw(garbage, label="replacement")
    if not path:
        return replacement
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if data.draw(st.booleans(), label="delete"):
        del parent[path[-1]]
    else:
        parent[path[-1]] = replacement
    return value


# --- 1. OIP v2 JSON tensors --------------------------------------------------------------------------------------

OIP_KEYS = st.sampled_from([
    "id", "parameters", "inputs", "outputs", "name", "shape", "datatype", "data", BINARY_DATA_SIZE, "binary_data",
    "binary_data_output", "dense_features", "sparse_features", "probabilities",
])
OIP_SCALARS = SCALARS | st.sampled_from([*DATATYPES, "dense_features", "sparse_features", "probabilities"])
OIP_GARBAGE = json_like(OIP_KEYS, OIP_SCALARS)
# mostly objects, and objects with a list of input-like objects, so that garbage gets past the top level
OIP_BODIES = (OIP_GARBAGE | st.dictionaries(OIP_KEYS, OIP_GARBAGE, max_size=5)
              | st.fixed_dictionaries({"inputs": st.lists(st.dictionaries(OIP_KEYS, OIP_GARBAGE, max_size=6),
                                                          max_size=3)}))


@st.composite
def dlrm_tensors(draw: st.DrawFn, max_rows: int = LIMITS.max_rows_per_request) -> tuple[np.ndarray, np.ndarray]:
    """A valid request: dense float32 [B, 13] (any finite value) and sparse ids [B, 26] or [B, 26, H] in range."""
    rows = draw(st.integers(1, max_rows), label="rows")
    dense = draw(hnp.arrays(np.float32, (rows, SPEC.num_dense),
                            elements=st.floats(width=32, allow_nan=False, allow_infinity=False)), label="dense")
    ids = draw(st.sampled_from([None, *range(1, LIMITS.max_ids_per_feature + 1)]), label="ids per table")
    shape = (rows, SPEC.num_tables) if ids is None else (rows, SPEC.num_tables, ids)
    raw = draw(hnp.arrays(np.int64, shape, elements=st.integers(-1, max(SPEC.table_sizes) - 1)), label="sparse")
    sizes = np.asarray(SPEC.table_sizes, dtype=np.int64).reshape(1, -1, *([1] * (raw.ndim - 2)))
    return dense, (raw + 1) % (sizes + 1) - 1  # each table's ids in -1 .. size - 1


def dlrm_request(dense: np.ndarray, sparse: np.ndarray, request_id: str | None = None) -> InferRequest:
    tensors = {"dense_features": torch.from_numpy(dense), "sparse_features": torch.from_numpy(sparse)}
    return encode_infer_request(tensors, request_id=request_id)


def decode_json(body: Any, binary_inputs=None) -> dict[str, torch.Tensor]:
    return decode_infer_inputs(InferRequest.model_validate(body), SIGNATURE, ID_RANGES, LIMITS, binary_inputs)


def decode_bytes(body: bytes, header_length: str | None = None) -> dict[str, torch.Tensor]:
    parsed = parse_infer_request(body, header_length)
    return decode_infer_inputs(parsed.request, SIGNATURE, ID_RANGES, LIMITS, parsed.binary_inputs)


def assert_names_a_field(error: APIError) -> None:
    """The API's refusal contract: a 4xx whose message starts with the field it names."""
    assert error.status_code in (400, 413), error.status_code
    assert error.param, error.message
    if error.code == "invalid_json":
        assert error.param == "body" and error.message.startswith("request body is not valid JSON")
    else:
        assert error.message.startswith(f"{error.param}: "), (error.param, error.message)
    event(f"refused {error.status_code}: {re.sub(r'[0-9]+', 'i', error.param)}")


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@settings(BASE, max_examples=150)
@given(tensors=dlrm_tensors(), int32=st.booleans(), nested=st.booleans())
def test_oip_json_valid_tensors_round_trip_exactly(tensors, int32, nested):
    dense, sparse = tensors
    body = dlrm_request(dense, sparse, request_id="r").model_dump(exclude_none=True)
    if int32:
        body["inputs"][1]["datatype"] = "INT32"
    if nested:  # nested lists of the tensor's shape are as good as a flat list
        body["inputs"][0]["data"], body["inputs"][1]["data"] = dense.tolist(), sparse.tolist()
    expected_sparse = sparse.reshape(sparse.shape[0], SPEC.num_tables, -1)
    for decoded in (decode_json(body), decode_bytes(json.dumps(body).encode())):
        assert same_bits(decoded["dense"].numpy(), dense)  # bit-exact, -0.0 and subnormals included
        assert same_bits(decoded["sparse"].numpy(), expected_sparse)


@settings(BASE, max_examples=200)
@given(body=OIP_BODIES)
def test_oip_json_garbage_is_refused_with_the_validation_error_only(body):
    try:
        decode_json(body)
    except ValidationError:
        pass
    except APIError as error:
        assert_names_a_field(error)
    try:
        decode_bytes(json.dumps(body).encode())
    except APIError as error:
        assert_names_a_field(error)


@settings(BASE, max_examples=200)
@given(tensors=dlrm_tensors(max_rows=2), data=st.data())
def test_oip_json_mutated_valid_request_parses_or_names_the_field(tensors, data):
    valid = dlrm_request(*tensors, request_id="r").model_dump(exclude_none=True)
    valid |= {"parameters": {"binary_data_output": False}, "outputs": [{"name": "probabilities"}]}
    body = mutated(data, valid, OIP_GARBAGE)
    try:
        inputs = decode_json(body)
    except ValidationError as error:
        assert error.errors()
    except APIError as error:
        assert_names_a_field(error)
    else:
        event("decoded")
        assert inputs["dense"].dtype == torch.float32 and inputs["sparse"].dtype == torch.int64
        assert inputs["dense"].shape[0] == inputs["sparse"].shape[0] <= LIMITS.max_rows_per_request
    try:
        decode_bytes(json.dumps(body).encode())
    except APIError as error:
        assert_names_a_field(error)


@settings(BASE, max_examples=200)
@given(tensors=dlrm_tensors(max_rows=3), which=st.sampled_from([0, 1]), reverse=st.booleans(), data=st.data())
def test_oip_json_data_length_not_matching_shape_is_refused_naming_the_data_field(tensors, which, reverse, data):
    body = dlrm_request(*tensors).model_dump(exclude_none=True)
    values = body["inputs"][which]["data"]
    expected = len(values)
    delta = data.draw(st.integers(-expected, 50).filter(bool), label="delta")
    body["inputs"][which]["data"] = (values * 5)[: expected + delta]  # >= 13 values: 5 copies cover + 50
    if reverse:  # positions in the message follow the request's order
        body["inputs"].reverse()
    index = 1 - which if reverse else which
    with pytest.raises(APIError) as raised:
        decode_json(body)
    assert raised.value.status_code == 400 and raised.value.param == f"inputs[{index}].data"
    assert raised.value.message == (f"inputs[{index}].data: shape {body['inputs'][index]['shape']} needs {expected} "
                                    f"values, data has {expected + delta}")


@settings(BASE, max_examples=200)
@given(tensors=dlrm_tensors(max_rows=3), which=st.sampled_from([0, 1]),
       shape=st.lists(st.integers(0, 40), max_size=4))
def test_oip_json_shape_not_fitting_the_model_is_refused_naming_a_shape_or_data_field(tensors, which, shape):
    body = dlrm_request(*tensors).model_dump(exclude_none=True)
    assume(shape != body["inputs"][which]["shape"])
    original = body["inputs"][which]["shape"]
    body["inputs"][which]["shape"] = shape
    try:
        decode_json(body)
    except APIError as error:
        assert_names_a_field(error)
        # the changed tensor's shape or data, or the sparse shape when the row counts now disagree
        assert error.param in (f"inputs[{which}].shape", f"inputs[{which}].data", "inputs[1].shape")
    else:  # only one other shape fits the same ids: [B, T] <-> [B, T, 1]
        assert which == 1 and shape[:2] == original[:2] and math.prod(shape) == math.prod(original)


# --- 2. OIP v2 binary tensor data --------------------------------------------------------------------------------

WIRE_NAMES = sorted(WIRE_DTYPES)


@st.composite
def wire_tensors(draw: st.DrawFn, allow_nan: bool = True) -> tuple[str, np.ndarray]:
    datatype = draw(st.sampled_from(WIRE_NAMES), label="datatype")
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4), label="shape")
    dtype = WIRE_DTYPES[datatype]
    elements = (hnp.from_dtype(dtype, allow_nan=allow_nan, allow_infinity=allow_nan)
                if dtype.kind == "f" else hnp.from_dtype(dtype))
    return datatype, draw(hnp.arrays(dtype, shape, elements=elements), label="array")


def binary_request(tensors: list[tuple[str, np.ndarray]], binary: list[bool],
                   names: list[str] | None = None) -> tuple[bytes, int]:
    """Client side of the extension, written independently of the parser: JSON header, then raw bytes."""
    inputs, raw = [], []
    names = names or [f"t{index}" for index in range(len(tensors))]
    for name, (datatype, array), is_binary in zip(names, tensors, binary, strict=True):
        tensor: dict[str, Any] = {"name": name, "shape": list(array.shape), "datatype": datatype}
        if is_binary:
            data = array.astype(WIRE_DTYPES[datatype]).tobytes()
            tensor["parameters"] = {BINARY_DATA_SIZE: len(data)}
            raw.append(data)
        else:
            tensor["data"] = [1] * array.size
        inputs.append(tensor)
    header = json.dumps({"inputs": inputs}).encode()
    return header + b"".join(raw), len(header)


@settings(BASE, max_examples=200)
@given(tensors=st.lists(wire_tensors(), min_size=1, max_size=4), data=st.data(), zeros=st.integers(0, 3))
def test_oip_binary_tensors_round_trip_bit_exactly(tensors, data, zeros):
    binary = data.draw(st.lists(st.booleans(), min_size=len(tensors), max_size=len(tensors)), label="binary")
    body, length = binary_request(tensors, binary)
    parsed = parse_infer_request(body, "0" * zeros + str(length))
    assert len(parsed.binary_inputs) == len(tensors)
    for (datatype, array), is_binary, got in zip(tensors, binary, parsed.binary_inputs, strict=True):
        if is_binary:
            assert same_bits(got, array.astype(WIRE_DTYPES[datatype]))
        else:
            assert got is None
    if not any(binary):  # a plain JSON body needs no header
        assert parse_infer_request(body, None).binary_inputs == (None,) * len(tensors)


@settings(BASE, max_examples=100)
@given(tensors=dlrm_tensors(max_rows=4), int32=st.booleans())
def test_oip_binary_dlrm_inputs_round_trip_exactly(tensors, int32):
    dense, sparse = tensors
    arrays = [("FP32", dense), ("INT32" if int32 else "INT64", sparse)]
    body, length = binary_request(arrays, [True, True], names=["dense_features", "sparse_features"])
    decoded = decode_bytes(body, str(length))
    assert same_bits(decoded["dense"].numpy(), dense)
    assert same_bits(decoded["sparse"].numpy(), sparse.reshape(len(sparse), SPEC.num_tables, -1))


@st.composite
def user_tensors(draw: st.DrawFn, max_rows: int = LIMITS.max_rows_per_request) -> tuple[np.ndarray, np.ndarray]:
    """A valid request of the user model: user ids [B] and item histories [B] or [B, L], each id in its table."""
    rows = draw(st.integers(1, max_rows), label="rows")
    user = draw(hnp.arrays(np.int64, rows, elements=st.integers(0, USERS - 1)), label="user")
    length = draw(st.sampled_from([None, *range(1, LIMITS.max_ids_per_feature + 1)]), label="history length")
    shape = (rows,) if length is None else (rows, length)
    return user, draw(hnp.arrays(np.int64, shape, elements=st.integers(0, ITEMS - 1)), label="history")


@settings(BASE, max_examples=100)
@given(tensors=user_tensors(), int32=st.booleans(), binary=st.booleans())
def test_oip_user_model_inputs_round_trip_exactly_by_forward_argument(tensors, int32, binary):
    user, history = tensors
    datatype = "INT32" if int32 else "INT64"
    arrays = [(datatype, user), (datatype, history)]
    if binary:
        body, length = binary_request(arrays, [True, True], names=["user", "history"])
        parsed = parse_infer_request(body, str(length))
    else:
        named = {"user": torch.from_numpy(user), "history": torch.from_numpy(history)}
        request = encode_infer_request(named).model_dump(exclude_none=True)
        for tensor in request["inputs"]:
            tensor["datatype"] = datatype
        parsed = parse_infer_request(json.dumps(request).encode(), None)
    decoded = decode_infer_inputs(parsed.request, USER_SIGNATURE, USER_ID_RANGES, LIMITS, parsed.binary_inputs)
    assert list(decoded) == ["user", "items"]
    assert same_bits(decoded["user"].numpy(), user)
    assert same_bits(decoded["items"].numpy(), history.reshape(len(history), -1))


@settings(BASE, max_examples=200)
@given(tensors=st.lists(wire_tensors(), min_size=1, max_size=3), data=st.data())
def test_oip_binary_truncated_or_extended_body_is_refused_naming_body_or_header(tensors, data):
    body, length = binary_request(tensors, [True] * len(tensors))
    if data.draw(st.booleans(), label="truncate"):
        cut = data.draw(st.integers(0, len(body) - 1), label="cut")
        body = body[:cut]
    else:
        body += data.draw(st.binary(min_size=1, max_size=64), label="extra")
    with pytest.raises(APIError) as raised:
        parse_infer_request(body, str(length))
    assert_names_a_field(raised.value)
    if length > len(body):
        assert raised.value.param == HEADER_LENGTH and "longer than the" in raised.value.message
    else:
        assert raised.value.param == "body"
        assert f"bytes follow the {length}-byte JSON header" in raised.value.message


HEADER_VALUES = (
    st.none()
    | st.text(max_size=12)
    | st.integers(0, 300).map(str)
    # header lengths of any number of digits, leading zeros included (int() refuses over 4300 digits)
    | st.builds(lambda count, digit, tail: digit * count + tail, st.integers(0, 6000), st.sampled_from("019"),
                st.text("0123456789", max_size=4))
)


@settings(BASE, max_examples=200)
@given(body=st.binary(max_size=300) | OIP_GARBAGE.map(lambda value: json.dumps(value).encode()), header=HEADER_VALUES,
       tail=st.binary(max_size=64))
def test_oip_binary_random_bodies_raise_only_api_errors(body, header, tail):
    try:
        parsed = parse_infer_request(body + tail, header)
    except APIError as error:
        assert_names_a_field(error)
    else:
        assert len(parsed.binary_inputs) == len(parsed.request.inputs)


@settings(BASE, max_examples=100)
@given(header=HEADER_VALUES.filter(lambda value: value is not None), body=st.binary(max_size=40))
def test_oip_binary_header_length_is_a_bounded_number_or_refused_naming_the_header(header, body):
    with pytest.raises(APIError) as raised:
        parse_infer_request(body, header)  # 40 bytes are never a valid request
    assert_names_a_field(raised.value)
    well_formed = header.isascii() and header.isdigit()
    digits = header.lstrip("0") if well_formed else ""
    if well_formed and len(digits) <= 3 and int(digits or "0") <= len(body):
        assert raised.value.param != HEADER_LENGTH  # the length is fine: the JSON it delimits is at fault
    else:
        assert raised.value.param == HEADER_LENGTH
        assert ("longer than the" if well_formed else "must be a non-negative integer") in raised.value.message


@settings(BASE, max_examples=100)
@given(outputs=st.lists(wire_tensors(allow_nan=False), min_size=1, max_size=3), data=st.data())
def test_oip_binary_response_outputs_round_trip(outputs, data):
    wants = data.draw(st.lists(st.booleans(), min_size=len(outputs), max_size=len(outputs)), label="binary")
    response = InferResponse(model_name="m", outputs=[
        InferTensor(name=f"o{i}", shape=list(array.shape), datatype=datatype, data=array.reshape(-1).tolist())
        for i, (datatype, array) in enumerate(outputs)
    ])
    body, length = encode_infer_response(response, BinaryOutputs(by_name={f"o{i}": w for i, w in enumerate(wants)}))
    assert (length is None) == (not any(wants))
    header = json.loads(body[:length] if length is not None else body)
    offset = length or len(body)
    for (datatype, array), want, tensor in zip(outputs, wants, header["outputs"], strict=True):
        if want:
            size = tensor["parameters"][BINARY_DATA_SIZE]
            assert "data" not in tensor
            got = np.frombuffer(body, WIRE_DTYPES[datatype], count=array.size, offset=offset).reshape(array.shape)
            assert same_bits(got, array.astype(WIRE_DTYPES[datatype])) and size == array.nbytes
            offset += size
        else:
            assert tensor["data"] == array.reshape(-1).tolist()
    assert offset == len(body)


# --- 3. base64 conditioning images -------------------------------------------------------------------------------

MAX_IMAGE_BYTES = 64 * 1024
MAX_PIXELS = 4096

rgb_images = hnp.arrays(np.uint8, st.tuples(st.integers(1, 12), st.integers(1, 12), st.just(3)))


def encode_image(array: np.ndarray, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format=image_format)
    return buffer.getvalue()


def decode_or_refuse(data: str, **limits: int) -> np.ndarray | None:
    """The decoded image, or None when refused with ``ConditioningImageError`` (anything else fails the test)."""
    limits = {"max_bytes": MAX_IMAGE_BYTES, "max_pixels": MAX_PIXELS} | limits
    try:
        image = decode_image(data, **limits)
    except ConditioningImageError as error:
        assert str(error)
        event(f"refused: {str(error)[:30]}")
        return None
    event("decoded")
    assert image.dtype == np.uint8 and image.ndim == 3 and image.shape[2] == 3
    assert image.shape[0] * image.shape[1] <= limits["max_pixels"]
    return image


@settings(BASE, max_examples=200)
@given(text=st.text(max_size=200) | st.text(max_size=200).map(lambda text: "data:image/png;base64," + text))
def test_image_random_text_raises_only_conditioning_image_error(text):
    assert decode_or_refuse(text) is None


@settings(BASE, max_examples=200)
@given(raw=st.binary(max_size=512), prefix=st.sampled_from([b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a"]),
       url=st.booleans())
def test_image_random_bytes_raise_only_conditioning_image_error(raw, prefix, url):
    text = base64.b64encode(prefix + raw).decode()
    assert decode_or_refuse(("data:image/png;base64," if url else "") + text) is None


@settings(BASE, max_examples=150)
@given(array=rgb_images, url=st.booleans())
def test_image_png_round_trips_exactly(array, url):
    text = base64.b64encode(encode_image(array)).decode()
    image = decode_or_refuse(("data:image/png;base64," if url else "") + text)
    assert image is not None and same_bits(image, array)


@settings(BASE, max_examples=150)
@given(array=rgb_images, image_format=st.sampled_from(["PNG", "JPEG"]), data=st.data())
def test_image_corrupted_png_or_jpeg_decodes_or_raises_only_conditioning_image_error(array, image_format, data):
    raw = bytearray(encode_image(array, image_format))
    for _ in range(data.draw(st.integers(0, 4), label="edits")):
        position = data.draw(st.integers(0, len(raw) - 1), label="position")
        raw[position] = data.draw(st.integers(0, 255), label="byte")
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw)), label="length")]
    decode_or_refuse(base64.b64encode(bytes(raw)).decode())


@settings(BASE, max_examples=100)
@given(array=rgb_images, max_pixels=st.integers(1, 150))
def test_image_over_max_pixels_is_refused(array, max_pixels):
    text = base64.b64encode(encode_image(array)).decode()
    pixels = array.shape[0] * array.shape[1]
    if pixels > max_pixels:
        with pytest.raises(ConditioningImageError, match=f"^image has more than {max_pixels} pixels$"):
            decode_image(text, max_bytes=MAX_IMAGE_BYTES, max_pixels=max_pixels)
    else:
        assert same_bits(decode_image(text, max_bytes=MAX_IMAGE_BYTES, max_pixels=max_pixels), array)


@settings(BASE, max_examples=100)
@given(array=rgb_images, slack=st.integers(-200, 200))
def test_image_over_max_bytes_is_refused_before_decoding(array, slack):
    raw = encode_image(array)
    max_bytes = max(1, len(raw) + slack)
    text = base64.b64encode(raw).decode()
    if len(raw) <= max_bytes:
        assert same_bits(decode_image(text, max_bytes=max_bytes, max_pixels=MAX_PIXELS), array)
    elif len(raw) >= max_bytes + 4:  # base64 padding makes the last 3 bytes of slack inexact
        with pytest.raises(ConditioningImageError, match=f"^image larger than {max_bytes} bytes$"):
            decode_image(text, max_bytes=max_bytes, max_pixels=MAX_PIXELS)


# --- 4a. LoRA names ----------------------------------------------------------------------------------------------

NAME_CHARS = string.ascii_letters + string.digits + "_.-"
lora_names = (
    st.text(max_size=140)
    | st.text(st.sampled_from(NAME_CHARS + "/\\\x00 é\n"), max_size=20)
    | st.text(st.sampled_from(NAME_CHARS), min_size=120, max_size=140)
    | st.lists(st.sampled_from(["..", ".", "/", "a", "Z9", "-", "_", "\x00", "\n", "é", "\u0661"]),
               max_size=8).map("".join)
)


def valid_by_documented_pattern(name: str) -> bool:
    """1-128 of [A-Za-z0-9_.-], starting alphanumeric, without '..' (written here without the module's regex)."""
    return (0 < len(name) <= 128 and name[0] in string.ascii_letters + string.digits
            and all(char in NAME_CHARS for char in name) and ".." not in name)


@settings(BASE, max_examples=300)
@given(name=lora_names)
def test_lora_name_is_valid_by_the_documented_pattern_or_refused(name):
    registry = LoRARegistry(Path("/nonexistent-lora-dir"))
    expected = valid_by_documented_pattern(name)
    assert is_valid_name(name) == expected
    with pytest.raises(LoRANotFound if expected else InvalidLoRAName) as raised:
        registry.resolve(name)
    assert raised.value.name == name and repr(name) in str(raised.value)


@settings(BASE, max_examples=50)
@given(value=st.none() | st.integers() | st.binary(max_size=8) | st.lists(st.text(max_size=3), max_size=2))
def test_lora_name_that_is_not_a_string_is_invalid(value):
    with pytest.raises(InvalidLoRAName):
        LoRARegistry(Path("/nonexistent-lora-dir")).resolve(value)


valid_names = st.text(st.sampled_from(NAME_CHARS), min_size=1, max_size=16).filter(valid_by_documented_pattern)
# How each ``<name>.safetensors`` entry is made, and whether the registry must serve it.
ENTRY_KINDS = {
    "file": True,
    "link-inside": True,  # symlink to a .safetensors file in a subdirectory of the registry
    "relative-link-inside": True,
    "link-outside": False,  # symlink to a .safetensors file outside the directory
    "relative-link-outside": False,  # ../outside.safetensors
    "link-to-other-suffix": False,  # symlink to a .bin file inside
    "link-to-directory": False,
    "link-to-safetensors-directory": False,
    "directory": False,
    "dangling-link": False,
    "loop": False,
}


def make_entry(root: Path, name: str, kind: str) -> None:
    entry = root / f"{name}.safetensors"
    outside = root.parent / "outside.safetensors"
    inside = root / "sub" / "inside.safetensors"
    links = {
        "link-inside": inside, "relative-link-inside": Path("sub/inside.safetensors"), "link-outside": outside,
        "relative-link-outside": Path("../outside.safetensors"), "link-to-other-suffix": root / "sub" / "w.bin",
        "link-to-directory": root / "sub", "link-to-safetensors-directory": root / "sub" / "dir.safetensors",
        "dangling-link": root / "sub" / "missing.safetensors", "loop": entry,
    }
    if kind == "file":
        entry.write_bytes(b"x")
    elif kind == "directory":
        entry.mkdir()
    else:
        entry.symlink_to(links[kind])


@settings(SLOW, max_examples=60)
@given(entries=st.dictionaries(valid_names, st.sampled_from(sorted(ENTRY_KINDS)), max_size=6),
       probes=st.lists(lora_names, max_size=4))
def test_lora_valid_name_never_resolves_outside_the_directory(tmp_path, entries, probes):
    base = fresh_dir(tmp_path)
    root = base / "loras"
    (root / "sub" / "dir.safetensors").mkdir(parents=True)
    (root / "sub" / "inside.safetensors").write_bytes(b"inside")
    (root / "sub" / "w.bin").write_bytes(b"pickle")
    (base / "outside.safetensors").write_bytes(b"secret")
    for name, kind in entries.items():
        make_entry(root, name, kind)
    registry = LoRARegistry(root)
    real_root = root.resolve()
    for name in [*entries, *probes, "../outside", "sub/inside"]:
        served = ENTRY_KINDS.get(entries.get(name), False)
        try:
            path = registry.resolve(name)
        except InvalidLoRAName:
            assert not valid_by_documented_pattern(name)
            continue
        except LoRANotFound:
            assert not served, (name, entries.get(name))
            continue
        assert served, (name, entries.get(name))
        assert path.is_relative_to(real_root) and path.suffix == ".safetensors" and path.is_file()
        assert path.read_bytes() in (b"x", b"inside")
    assert registry.names() == sorted(name for name, kind in entries.items() if ENTRY_KINDS[kind])


# --- 4b. LoRA files ----------------------------------------------------------------------------------------------

MAX_LORA_BYTES = 1 << 20
UNET_MODULES = [
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q",
    "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_k",
    "down_blocks.1.resnets.0.conv1",
    "mid_block.attentions.0.transformer_blocks.0.attn2.to_v",
]
TEXT_MODULES = ["encoder.layers.0.self_attn.q_proj", "encoder.layers.1.mlp.fc1"]


@pytest.fixture(scope="module")
def targets() -> LoRATargets:
    components = build_preset("tiny")
    return LoRATargets.from_modules(components.denoiser, components.text_encoder)


def load_or_refuse(path: Path, targets: LoRATargets) -> Any:
    """The loaded weights, or None when refused with ``LoRAFormatError`` naming the file (anything else fails)."""
    try:
        weights = load_lora_file(path, targets, max_file_bytes=MAX_LORA_BYTES)
    except LoRAFormatError as error:
        assert str(error).startswith(f"{path.name}: ") and error.reason
        event(f"refused: {error.reason[:25]}")
        return None
    event("loaded")
    for component in ("denoiser", "text_encoder"):
        shapes = getattr(targets, component)
        for module, layer in getattr(weights, component).items():
            rank = layer.down.shape[0]
            assert (tuple(layer.down.shape), tuple(layer.up.shape)) == shapes[module].factor_shapes(rank)
            assert math.isfinite(layer.scale)
            assert torch.isfinite(layer.down).all() and torch.isfinite(layer.up).all()
    return weights


@settings(SLOW, max_examples=100)
@given(raw=st.binary(max_size=512) | st.builds(lambda n, rest: struct.pack("<Q", n) + rest,
                                               st.integers(0, 2**64 - 1), st.binary(max_size=256)))
def test_lora_file_of_random_bytes_raises_only_lora_format_error(tmp_path, targets, raw):
    path = fresh_dir(tmp_path) / "random.safetensors"
    path.write_bytes(raw)
    assert load_or_refuse(path, targets) is None


ST_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "X", ""]
tensor_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(ST_DTYPES) | SCALARS,
    "shape": st.lists(st.integers(0, 8), max_size=4) | SCALARS,
    "data_offsets": st.lists(st.integers(0, 600), min_size=2, max_size=2) | SCALARS,
})
ST_KEYS = st.sampled_from([f"unet.{module}.lora_{factor}.weight" for module in UNET_MODULES for factor in "AB"]
                          + ["__metadata__", "lora_unet_x.alpha"])
random_headers = (
    st.dictionaries(ST_KEYS | st.text(max_size=20), tensor_entries | json_like(ST_KEYS), max_size=4)
    | json_like(ST_KEYS)
)


@settings(SLOW, max_examples=150)
@given(header=random_headers, pad=st.sampled_from([b"", b" ", b"\x00", b"\xff"]), data=st.binary(max_size=600),
       length_delta=st.sampled_from([0, 0, 0, -1, 1, 7]))
def test_lora_file_with_random_safetensors_header_raises_only_lora_format_error(tmp_path, targets, header, pad, data,
                                                                               length_delta):
    encoded = json.dumps(header).encode() + pad
    raw = struct.pack("<Q", max(0, len(encoded) + length_delta)) + encoded + data
    path = fresh_dir(tmp_path) / "header.safetensors"
    path.write_bytes(raw)
    load_or_refuse(path, targets)


def factor_tensors(targets: LoRATargets, module: str, component: str, rank: int) -> tuple[torch.Tensor, ...]:
    down, up = getattr(targets, component)[module].factor_shapes(rank)
    generator = torch.Generator().manual_seed(rank)
    return torch.randn(down, generator=generator) * 0.1, torch.randn(up, generator=generator) * 0.1


METADATA_KEYS = st.sampled_from([f"{component}.{field}" for component in ("unet", "text_encoder") for field in
                                 ("r", "lora_alpha", "rank_pattern", "alpha_pattern", "use_rslora", "use_dora",
                                  "lora_bias", "target_modules")])
PATTERN_KEYS = st.sampled_from(["attn1.to_q", "to_k", "conv1", "^down_blocks.1.resnets.0.conv1", ".*", "[", "a\n"])
METADATA_VALUES = (st.integers(-2, 8) | st.sampled_from(HUGE_INTS) | st.floats() | st.booleans() | st.none()
                   | st.dictionaries(PATTERN_KEYS | st.text(max_size=6), SCALARS | st.integers(1, 8), max_size=3)
                   | st.text(max_size=6))
adapter_metadata = (
    st.dictionaries(METADATA_KEYS, METADATA_VALUES, max_size=6).map(json.dumps)
    | json_like(METADATA_KEYS).map(json.dumps)
    | st.text(max_size=30)
    | st.integers(0, 100_000).map(lambda depth: "[" * depth + "]" * depth)  # nesting deeper than json's recursion
)


@settings(SLOW, max_examples=150)
@given(data=st.data(), metadata=st.none() | adapter_metadata)
def test_lora_file_with_random_keys_shapes_and_metadata_loads_or_raises_only_lora_format_error(tmp_path, targets,
                                                                                                data, metadata):
    tensors: dict[str, torch.Tensor] = {}
    for prefix, component, modules in (("unet", "denoiser", UNET_MODULES), ("text_encoder", "text_encoder",
                                                                            TEXT_MODULES)):
        for module in data.draw(st.lists(st.sampled_from(modules), max_size=2, unique=True), label=prefix):
            down, up = factor_tensors(targets, module, component, data.draw(st.integers(1, 4), label="rank"))
            tensors[f"{prefix}.{module}.lora_A.weight"] = down
            tensors[f"{prefix}.{module}.lora_B.weight"] = up
    keys = sorted(tensors)
    for _ in range(data.draw(st.integers(0, 3), label="edits")):
        edit = data.draw(st.sampled_from(["drop", "reshape", "dtype", "extra", "rename"]), label="edit")
        key = data.draw(st.sampled_from(keys), label="key") if keys else "unet.x.lora_A.weight"
        if edit == "drop":
            tensors.pop(key, None)
        elif edit == "reshape":
            shape = data.draw(st.lists(st.integers(0, 70), max_size=4), label="shape")
            tensors[key] = torch.zeros(shape)
        elif edit == "dtype" and key in tensors:
            dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool,
                                               torch.uint8]), label="dtype")
            tensors[key] = tensors[key].to(dtype)
        elif edit == "extra":
            name = data.draw(st.sampled_from(["unet.conv_in.weight", "lora_unet_x.alpha", "unet.x.lora_B.bias",
                                              "text_encoder_2.a.lora_A.weight", "dora_scale", "unet.a.alpha"])
                             | st.text(max_size=12).filter(lambda key: key and key != "__metadata__"),
                             label="extra key")
            tensors[name] = torch.full(data.draw(st.lists(st.integers(0, 3), max_size=2), label="extra shape"),
                                       data.draw(st.floats(width=32), label="fill"))
        elif edit == "rename" and key in tensors:
            tensors[key.replace("lora_A", "lora.down").replace("lora_B", "lora.up")] = tensors.pop(key)
    assume(tensors)
    path = fresh_dir(tmp_path) / "lora.safetensors"
    save_file(tensors, str(path), metadata=None if metadata is None else {"lora_adapter_metadata": metadata})
    load_or_refuse(path, targets)


@settings(SLOW, max_examples=100)
@given(metadata=st.dictionaries(METADATA_KEYS, METADATA_VALUES, max_size=6), rank=st.integers(1, 4))
def test_lora_adapter_metadata_values_load_or_raise_only_lora_format_error(tmp_path, targets, metadata, rank):
    module = UNET_MODULES[0]
    down, up = factor_tensors(targets, module, "denoiser", rank)
    path = fresh_dir(tmp_path) / "meta.safetensors"
    config = {"unet.r": rank} | metadata
    save_file({f"unet.{module}.lora_A.weight": down, f"unet.{module}.lora_B.weight": up}, str(path),
              metadata={"lora_adapter_metadata": json.dumps(config)})
    weights = load_or_refuse(path, targets)
    if weights is not None:
        assert torch.equal(weights.denoiser[module].down, down) and torch.equal(weights.denoiser[module].up, up)


# --- 5. autoconfig search spaces ---------------------------------------------------------------------------------

KNOB_VALUES = {
    "max_batch_size": st.integers(1, 65_536),
    "batch_wait_timeout_s": st.floats(0.0, 10.0),
    "device_share": st.floats(0.0, 1024.0, exclude_min=True),
    "num_replicas": st.integers(1, 65_536),
    "torch_threads": st.integers(1, 65_536),
}


@st.composite
def space_dicts(draw: st.DrawFn) -> dict[str, Any]:
    knobs = {}
    for name in KNOB_NAMES:
        if name == "torch_threads" and not draw(st.booleans(), label="torch_threads?"):
            continue
        values = draw(st.lists(KNOB_VALUES[name], min_size=1, max_size=4, unique=True), label=name)
        knobs[name] = {"values": values}
    space: dict[str, Any] = {"knobs": knobs}
    if draw(st.booleans(), label="max_total_share?"):
        space["max_total_share"] = draw(st.floats(0.0, 5000.0, exclude_min=True), label="max_total_share")
    return space


def fitting(space: dict[str, Any]) -> int:
    """How many configurations of ``space`` fit its max_total_share (computed here, not by the module)."""
    knobs = space["knobs"]
    others = math.prod(len(knobs[name]["values"]) for name in knobs if name not in ("device_share", "num_replicas"))
    limit = space.get("max_total_share")
    pairs = sum(1 for replicas in knobs["num_replicas"]["values"] for share in knobs["device_share"]["values"]
                if limit is None or replicas * share <= limit + 1e-9)
    return others * pairs


@settings(SLOW, max_examples=200)
@given(raw=space_dicts())
def test_space_valid_spaces_round_trip(tmp_path, raw):
    expected = fitting(raw)
    if expected == 0:
        with pytest.raises(SpaceError, match=r"^space: max_total_share: .* leaves no configuration$"):
            SearchSpace.parse(raw)
        return
    space = SearchSpace.parse(raw)
    assert space.size == expected
    for name, knob in raw["knobs"].items():
        assert space.values(name) == tuple(sorted(knob["values"]))
    assert SearchSpace.parse(space.to_dict()) == space
    path = fresh_dir(tmp_path) / "space.yaml"
    path.write_text(yaml.safe_dump(space.to_dict()))
    assert SearchSpace.from_yaml(path) == space
    assert SearchSpace.from_yaml(path).configurations() == space.configurations()


SPACE_KEYS = st.sampled_from(["knobs", "values", "max_total_share", *KNOB_NAMES])
SPACE_GARBAGE = json_like(SPACE_KEYS)


def parse_or_refuse(raw: Any) -> SearchSpace | None:
    try:
        space = SearchSpace.parse(raw)
    except SpaceError as error:
        assert str(error).startswith("space: ") and len(str(error)) > len("space: ")
        event("refused")
        return None
    event("parsed")
    assert 0 < space.size <= 100_000
    return space


@settings(BASE, max_examples=200)
@given(raw=SPACE_GARBAGE)
def test_space_garbage_raises_only_space_error(raw):
    parse_or_refuse(raw)


@settings(BASE, max_examples=200)
@given(raw=space_dicts(), data=st.data())
def test_space_mutated_valid_space_parses_or_raises_only_space_error(raw, data):
    assume(fitting(raw))
    parse_or_refuse(mutated(data, raw, SPACE_GARBAGE))


BAD_KNOB_VALUES = {
    "max_batch_size": st.integers(max_value=0) | st.integers(min_value=65_537) | st.floats() | st.text(max_size=3)
    | st.none() | st.booleans(),
    "batch_wait_timeout_s": st.floats(max_value=-1e-9) | st.floats(min_value=10.000001) | st.just(math.nan)
    | st.none() | st.text(st.sampled_from("abc"), max_size=3),
    "device_share": st.floats(max_value=0.0) | st.floats(min_value=1024.0001) | st.just(math.nan) | st.none(),
}
BAD_KNOB_VALUES["num_replicas"] = BAD_KNOB_VALUES["torch_threads"] = BAD_KNOB_VALUES["max_batch_size"]


@settings(BASE, max_examples=200)
@given(raw=space_dicts(), data=st.data())
def test_space_bad_knob_value_is_refused_naming_the_value(raw, data):
    knob = data.draw(st.sampled_from(sorted(raw["knobs"])), label="knob")
    values = raw["knobs"][knob]["values"]
    index = data.draw(st.integers(0, len(values) - 1), label="index")
    values[index] = data.draw(BAD_KNOB_VALUES[knob], label="bad value")
    with pytest.raises(SpaceError) as raised:
        SearchSpace.parse(raw)
    assert str(raised.value).startswith(f"space: knobs.{knob}.values[{index}]: "), str(raised.value)


@settings(SLOW, max_examples=75)
@given(content=st.binary(max_size=200)
       | SPACE_GARBAGE.map(lambda value: yaml.safe_dump(value).encode())
       | st.text(max_size=200).map(str.encode)
       | st.builds(lambda opener, depth: (opener * depth).encode(), st.sampled_from(["[", "{", "- "]),
                   st.integers(0, 3000)))
def test_space_file_of_random_content_raises_only_space_error_naming_the_file(tmp_path, content):
    path = fresh_dir(tmp_path) / "space.yaml"
    path.write_bytes(content)
    try:
        space = SearchSpace.from_yaml(path)
    except SpaceError as error:
        assert str(error).startswith(f"{path}: ")
        event(f"refused: {str(error)[len(str(path)) + 2:][:25]}")
    else:
        assert space.size > 0
