"""Packed lookups on the wire: ``LookupRequest`` and ``LookupResponse`` of embedding.proto written and read without
protobuf objects.

A packed request carries every slice's ids in one ``ids`` tensor with their ``counts``; its reply every slice's rows
in one ``rows`` tensor with their ``widths``. These functions write and read exactly those protobuf messages, so any
protobuf library reads what they write and they read what any writes (fields in any order, unknown fields skipped,
repeated integers packed or not). What they save is copies: a reply's rows go from the lookup's buffer into the
sent bytes once, and received tensors are views of the received bytes (read-only memory: clone before writing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from disagg.rpc import wire

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
#: Field numbers in embedding.proto.
_REQUEST_INPUTS, _REQUEST_DTYPE, _REQUEST_IDS, _REQUEST_COUNTS, _REQUEST_SEQUENCE = 1, 2, 3, 4, 5
_REPLY_OUTPUTS, _REPLY_VERSION, _REPLY_ROWS, _REPLY_WIDTHS = 1, 2, 3, 4
_REPLY_SEQUENCE, _REPLY_STATUS, _REPLY_ERROR = 5, 6, 7
_TENSOR_NAME, _TENSOR_DTYPE, _TENSOR_SHAPE, _TENSOR_DATA = 1, 2, 3, 4
_INT64_SIGN = 1 << 63


class PackedRequest(NamedTuple):
    """A packed ``LookupRequest``: ``ids`` (1-D, viewing the request bytes), ``counts`` per input, ``output_dtype``,
    and its ``sequence`` on a ``LookupStream`` (0 otherwise)."""

    ids: torch.Tensor
    counts: list[int]
    output_dtype: str
    sequence: int = 0


class PackedReply(NamedTuple):
    """A packed ``LookupResponse``: ``rows`` (1-D, viewing the reply bytes), ``widths`` per output, ``version``."""

    rows: torch.Tensor
    widths: list[int]
    version: str


class StreamHeader(NamedTuple):
    """What routes a ``LookupResponse`` on a ``LookupStream``: the request's ``sequence``, and for a refusal its
    gRPC ``status`` code (0: answered) and ``error``."""

    sequence: int
    status: int
    error: str


class _TensorField(NamedTuple):
    """A ``Tensor`` message read off the wire, with ``data`` a view of the message bytes (what ``wire.decode``
    takes)."""

    name: str
    dtype: str
    shape: list[int]
    data: memoryview


def encode_request(ids: torch.Tensor, counts: Sequence[int], output_dtype: str = "", sequence: int = 0) -> bytes:
    """A packed ``LookupRequest``: ``ids`` (1-D) holding ``counts[i]`` ids of input ``i`` in order; ``sequence``
    numbers it on a ``LookupStream``."""
    return _message([(_REQUEST_DTYPE, output_dtype.encode()), (_REQUEST_COUNTS, _packed(counts))],
                    (_REQUEST_IDS, "ids", ids), _varint_field(_REQUEST_SEQUENCE, sequence))


def encode_reply(rows: torch.Tensor, widths: Sequence[int], version: str, sequence: int = 0) -> bytes:
    """A packed ``LookupResponse``: ``rows`` (1-D, every output flattened in order), ``widths`` per output;
    ``sequence``: the request's on a ``LookupStream`` (written first, where ``stream_header`` finds it at once)."""
    return _message([(_REPLY_VERSION, version.encode()), (_REPLY_WIDTHS, _packed(widths))], (_REPLY_ROWS, "rows", rows),
                    _varint_field(_REPLY_SEQUENCE, sequence))


def encode_refusal(sequence: int, status: int, error: str) -> bytes:
    """A ``LookupResponse`` on a ``LookupStream`` refusing request ``sequence`` with gRPC status code ``status``."""
    if status <= 0:
        raise ValueError(f"a refusal's status is a non-zero gRPC status code, got {status}")
    return b"".join((_varint_field(_REPLY_SEQUENCE, sequence), _varint_field(_REPLY_STATUS, status),
                     _field(_REPLY_ERROR, error.encode())))


def stream_header(raw: bytes) -> StreamHeader:
    """The ``sequence``, ``status`` and ``error`` of the ``LookupResponse`` ``raw`` (other fields skipped, not
    read); ValueError naming the field for bytes that are not such a message."""
    sequence, status, error = 0, 0, ""
    for number, wire_type, value in _fields(memoryview(raw), "LookupResponse"):
        if number in (_REPLY_SEQUENCE, _REPLY_STATUS):
            if wire_type != _VARINT:
                raise ValueError(f"`{'sequence' if number == _REPLY_SEQUENCE else 'status'}` must be an integer")
            if number == _REPLY_SEQUENCE:
                sequence = value
            else:
                status = value
        elif number == _REPLY_ERROR:
            error = _text(value, wire_type, "error")
    return StreamHeader(sequence, status, error)


def parse_request(raw: bytes, *, max_elements: int = wire.DEFAULT_MAX_ELEMENTS) -> PackedRequest | None:
    """``raw`` read as a packed ``LookupRequest``; None when it names its inputs instead (``inputs``, the protobuf
    path). ValueError naming the field for bytes that are not such a message."""
    view = memoryview(raw)
    ids, counts, output_dtype, named, sequence = None, [], "", False, 0
    for number, wire_type, value in _fields(view, "LookupRequest"):
        if number == _REQUEST_INPUTS:
            named = True
        elif number == _REQUEST_SEQUENCE:
            if wire_type != _VARINT:
                raise ValueError("`sequence` must be an integer")
            sequence = value
        elif number == _REQUEST_DTYPE:
            output_dtype = _text(value, wire_type, "output_dtype")
        elif number == _REQUEST_IDS:
            ids = _tensor(value, wire_type, "ids")
        elif number == _REQUEST_COUNTS:
            counts.extend(_integers(value, wire_type, "counts"))
    if named:
        if ids is not None or counts:
            raise ValueError("a packed request (ids, counts) carries no `inputs`")
        return None
    if ids is None:
        raise ValueError("a LookupRequest needs `ids` (packed) or `inputs`; it has neither")
    return PackedRequest(wire.decode(ids, max_elements=max_elements), counts, output_dtype, sequence)


def parse_reply(raw: bytes, *, max_elements: int = wire.DEFAULT_MAX_ELEMENTS) -> PackedReply:
    """``raw`` read as a packed ``LookupResponse``; ValueError naming the field when it is not one."""
    view = memoryview(raw)
    rows, widths, version = None, [], ""
    for number, wire_type, value in _fields(view, "LookupResponse"):
        if number == _REPLY_OUTPUTS:
            raise ValueError("a packed lookup got a reply with named `outputs`")
        if number == _REPLY_VERSION:
            version = _text(value, wire_type, "version")
        elif number == _REPLY_ROWS:
            rows = _tensor(value, wire_type, "rows")
        elif number == _REPLY_WIDTHS:
            widths.extend(_integers(value, wire_type, "widths"))
    if rows is None:
        raise ValueError("the LookupResponse holds no `rows`")
    return PackedReply(wire.decode(rows, max_elements=max_elements), widths, version)


# -- writing ---------------------------------------------------------------------------------------------------------

def _message(fields: list[tuple[int, bytes]], tensor: tuple[int, str, torch.Tensor], first: bytes = b"") -> bytes:
    """``first`` (written fields), ``fields`` (length-delimited, empty ones left out) then the tensor field last, its
    data copied once."""
    number, name, values = tensor
    dtype = wire.dtype_name(values, name)
    if values.dim() != 1:
        raise ValueError(f"tensor {name!r}: packed tensors are 1-D, got shape {list(values.shape)}")
    data = values.detach().to("cpu").contiguous().view(torch.uint8).numpy()
    tensor_head = b"".join((_field(_TENSOR_NAME, name.encode()), _field(_TENSOR_DTYPE, dtype.encode()),
                            _field(_TENSOR_SHAPE, _varint(values.shape[0])), _key(_TENSOR_DATA), _varint(data.nbytes)))
    head = b"".join([first, *(_field(n, value) for n, value in fields if value),
                     _key(number), _varint(len(tensor_head) + data.nbytes), tensor_head])
    return b"".join((head, data))


def _field(number: int, value: bytes) -> bytes:
    return b"".join((_key(number), _varint(len(value)), value))


def _varint_field(number: int, value: int) -> bytes:
    """A varint field (nothing for 0, proto3's default)."""
    return _varint(number << 3 | _VARINT) + _varint(value) if value else b""


def _key(number: int) -> bytes:
    return _varint(number << 3 | _LENGTH)


def _packed(values: Sequence[int]) -> bytes:
    return b"".join(_varint(value) for value in values)


def _varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"cannot write the negative count {value}")
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# -- reading ---------------------------------------------------------------------------------------------------------

def _fields(view: memoryview, message: str):
    """``(field number, wire type, value)`` of every field of the message in ``view``: an int for varints, a
    ``memoryview`` for the others. ValueError naming ``message`` for truncated or malformed bytes."""
    position, end = 0, len(view)
    while position < end:
        key, position = _read_varint(view, position, message)
        number, wire_type = key >> 3, key & 7
        if number == 0:
            raise ValueError(f"malformed {message}: field number 0")
        if wire_type == _VARINT:
            value, position = _read_varint(view, position, message)
        elif wire_type == _LENGTH:
            length, position = _read_varint(view, position, message)
            if position + length > end:
                raise ValueError(f"malformed {message}: field {number} runs past the end of the message")
            value, position = view[position:position + length], position + length
        elif wire_type in (_FIXED64, _FIXED32):
            size = 8 if wire_type == _FIXED64 else 4
            if position + size > end:
                raise ValueError(f"malformed {message}: field {number} runs past the end of the message")
            value, position = view[position:position + size], position + size
        else:
            raise ValueError(f"malformed {message}: field {number} has unsupported wire type {wire_type}")
        yield number, wire_type, value


def _read_varint(view: memoryview, position: int, message: str) -> tuple[int, int]:
    value = shift = 0
    while True:
        if position >= len(view) or shift > 63:
            raise ValueError(f"malformed {message}: a varint is truncated or longer than 10 bytes")
        byte = view[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def _text(value: int | memoryview, wire_type: int, field: str) -> str:
    if wire_type != _LENGTH:
        raise ValueError(f"`{field}` must be a string")
    try:
        return bytes(value).decode()
    except UnicodeDecodeError:
        raise ValueError(f"`{field}` is not valid UTF-8") from None


def _integers(value: int | memoryview, wire_type: int, field: str) -> list[int]:
    """A repeated int64 field's values, packed or one per field; ValueError for negative ones."""
    if wire_type == _VARINT:
        values = [value]
    elif wire_type == _LENGTH:
        values, position = [], 0
        while position < len(value):
            number, position = _read_varint(value, position, field)
            values.append(number)
    else:
        raise ValueError(f"`{field}` must hold integers")
    if any(number >= _INT64_SIGN for number in values):
        raise ValueError(f"`{field}` holds a negative value")
    return values


def _tensor(value: int | memoryview, wire_type: int, field: str) -> _TensorField:
    if wire_type != _LENGTH:
        raise ValueError(f"`{field}` must be a Tensor message")
    name, dtype, shape, data = "", "", [], memoryview(b"")
    for number, inner_type, inner in _fields(value, f"Tensor `{field}`"):
        if number == _TENSOR_NAME:
            name = _text(inner, inner_type, f"{field}.name")
        elif number == _TENSOR_DTYPE:
            dtype = _text(inner, inner_type, f"{field}.dtype")
        elif number == _TENSOR_SHAPE:
            shape.extend(_integers(inner, inner_type, f"{field}.shape"))
        elif number == _TENSOR_DATA:
            if inner_type != _LENGTH:
                raise ValueError(f"`{field}.data` must be bytes")
            data = inner
    return _TensorField(name or field, dtype, shape, data)
