"""Packed lookups written and read by hand (``disagg.rpc.packed``) are the protobuf messages of embedding.proto:
protobuf reads what they write, they read what protobuf writes (any field order, unpacked integers, unknown
fields), received tensors view the received bytes, and malformed bytes are refused naming the field."""

import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.rpc import packed, wire
from disagg.rpc._proto import embedding_pb2 as pb


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_protobuf_reads_a_written_reply(dtype):
    rows = torch.randn(3 * 4 + 2 * 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    message = pb.LookupResponse.FromString(packed.encode_reply(rows, [4, 8], "v-7"))
    assert (message.version, list(message.widths), len(message.outputs)) == ("v-7", [4, 8], 0)
    assert torch.equal(wire.decode(message.rows), rows)


def test_protobuf_reads_a_written_request():
    ids = torch.tensor([3, 1, 4, 1, 5], dtype=torch.int32)
    message = pb.LookupRequest.FromString(packed.encode_request(ids, [2, 0, 3], "float16"))
    assert (message.output_dtype, list(message.counts), len(message.inputs)) == ("float16", [2, 0, 3], 0)
    assert torch.equal(wire.decode(message.ids), ids)


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 300), max_size=6), version=st.text(max_size=40),
       width=st.integers(1, 40), dtype=st.sampled_from(["", "float32", "float16", "bfloat16"]))
def test_protobuf_written_messages_read_back_equal(counts, version, width, dtype):
    ids = torch.arange(sum(counts), dtype=torch.int64) * 7
    request = pb.LookupRequest(ids=wire.encode("ids", ids), counts=counts, output_dtype=dtype).SerializeToString()
    parsed = packed.parse_request(request)
    assert parsed.counts == counts and parsed.output_dtype == dtype and torch.equal(parsed.ids, ids)
    rows = torch.arange(sum(counts) * width, dtype=torch.float32)
    reply = pb.LookupResponse(rows=wire.encode("rows", rows), widths=[width] * len(counts), version=version)
    read = packed.parse_reply(reply.SerializeToString())
    assert read.version == version and read.widths == [width] * len(counts) and torch.equal(read.rows, rows)


def test_fields_in_any_order_unpacked_integers_and_unknown_fields_are_read():
    ids = wire.encode("ids", torch.tensor([9, 8], dtype=torch.int32)).SerializeToString()
    unknown = b"\x78\x05" + b"\x82\x01\x03abc"  # field 15 varint, field 16 bytes
    raw = b"\x20\x01" + b"\x1a" + bytes([len(ids)]) + ids + unknown + b"\x20\x01" + b"\x12\x07float16"
    assert pb.LookupRequest.FromString(raw).counts == [1, 1]  # protobuf agrees on what the bytes say
    parsed = packed.parse_request(raw)
    assert parsed.counts == [1, 1] and parsed.output_dtype == "float16" and parsed.ids.tolist() == [9, 8]


def test_a_read_reply_views_the_received_bytes():
    raw = packed.encode_reply(torch.arange(6, dtype=torch.float32), [3], "v")
    rows = packed.parse_reply(raw).rows
    start = raw.index(torch.arange(6, dtype=torch.float32).numpy().tobytes())
    assert rows.data_ptr() == np.frombuffer(raw, dtype=np.uint8).ctypes.data + start


def test_a_named_request_is_left_to_protobuf():
    named = pb.LookupRequest(inputs=[wire.encode("t", torch.tensor([1]))]).SerializeToString()
    assert packed.parse_request(named) is None


@pytest.mark.parametrize(("raw", "error"), [
    (b"\x1a\x05ab", "field 3 runs past the end of the message"),
    (b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "varint is truncated or longer than 10 bytes"),
    (b"\x00\x01", "field number 0"),
    (b"\x1b", "unsupported wire type 3"),
    (b"\x12\x02\xff\xfe", "`output_dtype` is not valid UTF-8"),
    (b"\x20\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", "`counts` holds a negative value"),
    (b"\x18\x01", "`ids` must be a Tensor message"),
    (b"\x12\x00", "needs `ids` (packed) or `inputs`; it has neither"),
    (b"\x1a\x10\x12\x05int32\x1a\x01\x03\x22\x04\x00\x00\x00\x00",
     "data holds 4 bytes, but shape [3] of int32 needs 12"),
])
def test_malformed_requests_are_refused_naming_the_field(raw, error):
    with pytest.raises(ValueError, match=re.escape(error)):
        packed.parse_request(raw)


def test_a_reply_without_rows_or_with_named_outputs_is_refused():
    with pytest.raises(ValueError, match="holds no `rows`"):
        packed.parse_reply(pb.LookupResponse(version="v").SerializeToString())
    named = pb.LookupResponse(outputs=[wire.encode("x", torch.zeros(1))]).SerializeToString()
    with pytest.raises(ValueError, match="named `outputs`"):
        packed.parse_reply(named)


def test_writing_refuses_what_the_wire_cannot_carry():
    with pytest.raises(ValueError, match="packed tensors are 1-D"):
        packed.encode_reply(torch.zeros(2, 2), [2], "v")
    with pytest.raises(ValueError, match=r"dtype torch\.float64 is not supported"):
        packed.encode_request(torch.zeros(2, dtype=torch.float64), [2])
