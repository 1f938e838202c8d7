"""OIP v2 <-> model tensor conversion, for the DLRM's signature and a user model's: happy paths and every refusal,
naming the client's field."""

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from disagg.api.codec import decode_infer_inputs, encode_infer_request, encode_outputs, model_metadata
from disagg.api.protocol import InferRequest, RequestedOutput
from disagg.config import DLRMLimits
from disagg.id_ranges import IdRange
from disagg.signature import InputSignature, ModelSignature, OutputSignature, dlrm_signature
from disagg.spec import preset_spec
from serving.common.errors import APIError
from tests.helpers.oip_fakes import ITEMS, USER_ID_RANGES, USER_SIGNATURE, USERS, dlrm_id_ranges

SPEC = preset_spec("tiny")
SIGNATURE = dlrm_signature(SPEC.num_dense, SPEC.num_tables)
ID_RANGES = dlrm_id_ranges(SPEC)
MAX_ROWS = 8
MAX_IDS = 4
LIMITS = DLRMLimits(max_rows_per_request=MAX_ROWS, max_ids_per_feature=MAX_IDS)


def valid_tensors(rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    dense = torch.arange(rows * SPEC.num_dense, dtype=torch.float32).reshape(rows, SPEC.num_dense) / 7
    sparse = torch.tensor(
        [[(row + table) % size for table, size in enumerate(SPEC.table_sizes)] for row in range(rows)]
    )
    return dense, sparse


def dlrm_body(dense: torch.Tensor, sparse: torch.Tensor, request_id: str | None = None) -> dict[str, Any]:
    request = encode_infer_request({"dense_features": dense, "sparse_features": sparse}, request_id=request_id)
    return request.model_dump(exclude_none=True)


def valid_body(rows: int = 3) -> dict[str, Any]:
    return dlrm_body(*valid_tensors(rows), request_id="r-1")


def multi_hot(rows: int = 3, ids: int = MAX_IDS) -> torch.Tensor:
    """[rows, tables, ids]: row r holds r + 1 valid ids per table (capped at ``ids``), then -1 padding."""
    sparse = torch.full((rows, SPEC.num_tables, ids), -1)
    for row in range(rows):
        for slot in range(min(row + 1, ids)):
            sparse[row, :, slot] = torch.tensor([(row + slot) % size for size in SPEC.table_sizes])
    return sparse


def decode(body: dict[str, Any], binary_inputs=None) -> dict[str, torch.Tensor]:
    return decode_infer_inputs(InferRequest.model_validate(body), SIGNATURE, ID_RANGES, LIMITS, binary_inputs)


def test_round_trip_gives_back_one_hot_ids_as_bags_of_one_keyed_by_forward_argument() -> None:
    dense, sparse = valid_tensors()
    inputs = decode(valid_body())
    assert list(inputs) == ["dense", "sparse"]
    assert inputs["dense"].dtype == torch.float32 and inputs["sparse"].dtype == torch.int64
    assert torch.equal(inputs["dense"], dense)
    assert inputs["sparse"].shape == (3, SPEC.num_tables, 1)
    assert torch.equal(inputs["sparse"][:, :, 0], sparse)


def test_multi_hot_ids_with_empty_slots_pass_unchanged() -> None:
    dense, sparse = valid_tensors()[0], multi_hot()
    inputs = decode(dlrm_body(dense, sparse))
    assert torch.equal(inputs["sparse"], sparse)
    assert inputs["sparse"].dtype == torch.int64


def test_empty_slot_is_valid_in_one_hot_input_too() -> None:
    body = valid_body()
    body["inputs"][1]["data"][0] = -1
    assert decode(body)["sparse"][0, 0, 0] == -1


def test_binary_inputs_replace_json_data() -> None:
    dense, sparse = valid_tensors()[0], multi_hot()
    body = dlrm_body(dense, sparse)
    body["inputs"][1]["datatype"] = "INT32"
    for tensor in body["inputs"]:
        del tensor["data"]
    binary = [dense.numpy().astype("<f4"), sparse.numpy().astype("<i4")]
    for array in binary:
        array.flags.writeable = False  # as parse_infer_request gives them: views of the body
    inputs = decode(body, binary)
    assert torch.equal(inputs["dense"], dense)
    assert torch.equal(inputs["sparse"], sparse) and inputs["sparse"].dtype == torch.int64
    assert not any(np.shares_memory(inputs[name].numpy(), array) for name, array in zip(inputs, binary, strict=True))


def test_non_finite_binary_dense_value_is_refused() -> None:
    dense, sparse = valid_tensors()
    dense[2, 4] = float("inf")
    body = dlrm_body(dense, sparse)
    del body["inputs"][0]["data"]
    with pytest.raises(APIError, match=r"value inf at row 2, position 4 is not a finite FP32 number \(1 such"):
        decode(body, [dense.numpy(), None])


def test_nested_data_inputs_in_any_order_and_int32_ids_are_accepted() -> None:
    dense, sparse = valid_tensors()
    body = valid_body()
    body["inputs"].reverse()
    body["inputs"][0] |= {"datatype": "INT32", "data": sparse.tolist()}
    body["inputs"][1]["data"] = dense.tolist()
    inputs = decode(body)
    assert list(inputs) == ["dense", "sparse"]  # signature order, whatever the request's
    assert torch.equal(inputs["dense"], dense)
    assert torch.equal(inputs["sparse"], sparse.unsqueeze(2))
    assert inputs["sparse"].dtype == torch.int64


def test_integer_json_values_are_valid_fp32() -> None:
    body = valid_body(rows=1)
    body["inputs"][0]["data"] = list(range(SPEC.num_dense))
    assert decode(body)["dense"].tolist() == [[float(i) for i in range(SPEC.num_dense)]]


def test_requesting_the_probabilities_output_by_name_is_accepted() -> None:
    body = valid_body() | {"outputs": [{"name": "probabilities"}]}
    assert decode(body)["dense"].shape == (3, SPEC.num_dense)


def test_data_left_out_without_binary_data_is_refused() -> None:
    body = valid_body()
    del body["inputs"][0]["data"]
    with pytest.raises(APIError, match=r"^inputs\[0\]\.data: field required"):
        decode(body)


def set_at(path: tuple, value: Any) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        target = body
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def set_value(tensor: int, flat_index: int, value: Any) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        body["inputs"][tensor]["data"][flat_index] = value

    return mutate


def set_multi_hot(ids: int, at: tuple[int, int, int] | None = None, value: int = 0) -> Callable[[dict], None]:
    """Sparse input as [3, 26, ids] bags, with ``value`` at position ``at`` if given."""

    def mutate(body: dict) -> None:
        sparse = multi_hot(ids=ids)
        if at is not None:
            sparse[at] = value
        body["inputs"][1] |= {"shape": list(sparse.shape), "data": sparse.reshape(-1).tolist()}

    return mutate


def reshape(tensor: int, shape: list[int], data_length: int | None = None) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        entry = body["inputs"][tensor]
        entry["shape"] = shape
        count = math.prod(shape) if data_length is None else data_length
        entry["data"] = (entry["data"] * (count // len(entry["data"]) + 1))[:count]

    return mutate


TABLE_3 = 3  # row 1's id for table 3 sits at flat index 1 * 26 + 3
ERROR_CASES = {
    "missing input": (
        lambda body: body["inputs"].pop(1),
        "inputs",
        "missing input 'sparse_features'; expected 'dense_features' and 'sparse_features'",
    ),
    "unknown input": (
        lambda body: body["inputs"].append(dict(body["inputs"][0], name="user_age")),
        "inputs[2].name",
        "unknown input 'user_age'; expected 'dense_features' and 'sparse_features'",
    ),
    "duplicate input": (
        lambda body: body["inputs"].append(dict(body["inputs"][0])),
        "inputs[2].name",
        "duplicate input 'dense_features'",
    ),
    "dense datatype": (set_at(("inputs", 0, "datatype"), "FP64"), "inputs[0].datatype", "must be FP32"),
    "sparse datatype": (set_at(("inputs", 1, "datatype"), "FP32"), "inputs[1].datatype", "must be INT64 or INT32"),
    "rank": (reshape(0, [39]), "inputs[0].shape", "dense_features must have shape [-1, 13] (-1: any number of rows), "
             "got [39]"),
    "sparse rank": (reshape(1, [3, 26, 1, 1]), "inputs[1].shape", "must have shape [-1, 26, -1] or [-1, 26] (-1: any "
                    "size), got [3, 26, 1, 1]"),
    "dense feature count": (reshape(0, [3, 12]), "inputs[0].shape", "needs 13 values along dimension 1, got 12"),
    "table count": (reshape(1, [3, 25]), "inputs[1].shape", "sparse_features needs 26 values along dimension 1"),
    "multi-hot table count": (reshape(1, [3, 25, 2]), "inputs[1].shape", "needs 26 values along dimension 1, got 25"),
    "too many ids per table": (
        set_multi_hot(MAX_IDS + 1),
        "inputs[1].shape",
        f"sparse_features has 5 values along dimension 2, over the limit of {MAX_IDS} per variable dimension",
    ),
    "no id slots": (reshape(1, [3, 26, 0]), "inputs[1].shape", "has no values along dimension 2"),
    "data shorter than shape": (reshape(0, [3, 13], data_length=38), "inputs[0].data", "needs 39 values, data has 38"),
    "too many rows": (
        lambda body: [reshape(i, [MAX_ROWS + 1, w])(body) for i, w in ((0, 13), (1, 26))],
        "inputs[0].shape",
        f"9 rows exceed the limit of {MAX_ROWS}",
    ),
    "no rows": (reshape(0, [0, 13]), "inputs[0].shape", "has no rows"),
    "row count mismatch": (
        reshape(1, [2, 26]),
        "inputs[1].shape",
        "sparse_features has 2 rows but dense_features has 3",
    ),
    "id past table end": (
        set_value(1, 26 + TABLE_3, 1000),
        "inputs[1].data",
        "id 1000 in row 1, position 3 is out of range for table embeddings.3 (valid ids 0..999, or -1 for an empty "
        "slot; 1 id(s) out of range)",
    ),
    "negative id": (
        set_value(1, 26 + TABLE_3, -2),
        "inputs[1].data",
        "id -2 in row 1, position 3 is out of range for table embeddings.3",
    ),
    "id past table end in a bag": (
        set_multi_hot(2, at=(2, TABLE_3, 1), value=1000),
        "inputs[1].data",
        "id 1000 in row 2, position [3, 1] is out of range for table embeddings.3 (valid ids 0..999, or -1",
    ),
    "negative id in a bag": (
        set_multi_hot(2, at=(0, 5, 1), value=-7),
        "inputs[1].data",
        "id -7 in row 0, position [5, 1] is out of range for table embeddings.5",
    ),
    "float id": (set_value(1, 0, 1.5), "inputs[1].data", "must be integers"),
    "huge id": (set_value(1, 0, 2**70), "inputs[1].data", "must be integers"),
    "nan": (set_value(0, 14, float("nan")), "inputs[0].data", "value nan at row 1, position 1 is not a finite"),
    "infinity": (set_value(0, 0, float("inf")), "inputs[0].data", "is not a finite"),
    "fp32 overflow": (set_value(0, 0, 1e39), "inputs[0].data", "is not a finite FP32 number"),
    "string value": (set_value(0, 0, "1.5"), "inputs[0].data", "must be numbers"),
    "ragged nested data": (
        set_at(("inputs", 0, "data"), [[0.0] * 13, [0.0] * 13, [0.0] * 12]),
        "inputs[0].data",
        "nested lists of equal length",
    ),
    "nested data of another shape": (
        set_at(("inputs", 0, "data"), [[0.0] * 3] * 13),
        "inputs[0].data",
        "nested data has shape [13, 3] but shape is [3, 13]",
    ),
    "unknown output": (
        set_at(("outputs",), [{"name": "probabilities"}, {"name": "logits"}]),
        "outputs[1].name",
        "unknown output 'logits'; this model has 'probabilities'",
    ),
    "duplicate output": (
        set_at(("outputs",), [{"name": "probabilities"}, {"name": "probabilities"}]),
        "outputs[1].name",
        "duplicate output 'probabilities'",
    ),
}


@pytest.mark.parametrize("case", ERROR_CASES, ids=list(ERROR_CASES))
def test_bad_input_is_a_4xx_naming_the_field(case: str) -> None:
    """400, except 413 for more rows than a request may carry."""
    mutate, param, message = ERROR_CASES[case]
    body = valid_body()
    mutate(body)
    with pytest.raises(APIError) as raised:
        decode(body)
    assert raised.value.status_code == (413 if case == "too many rows" else 400)
    assert raised.value.param == param
    assert raised.value.message.startswith(f"{param}: ")
    assert message in raised.value.message


def test_out_of_range_ids_are_counted() -> None:
    body = valid_body()
    body["inputs"][1]["data"][:3] = [5000, 5000, 5000]
    with pytest.raises(APIError, match=r"row 0, position 0 is out of range for table embeddings\.0 .*3 id\(s\) out of"):
        decode(body)


def test_response_carries_flat_fp32_probabilities_and_the_request_id() -> None:
    probabilities = torch.tensor([[0.25], [0.5], [0.125]])
    response = encode_outputs([probabilities], SIGNATURE, requested=None, model_name="dlrm", model_version="1",
                              request_id="r-1")
    assert (response.model_name, response.model_version, response.id) == ("dlrm", "1", "r-1")
    [output] = response.outputs
    assert (output.name, output.datatype, output.shape) == ("probabilities", "FP32", [3, 1])
    assert output.data == [0.25, 0.5, 0.125]


def test_model_metadata_describes_the_signature() -> None:
    metadata = model_metadata("ctr", "1", SIGNATURE)
    assert (metadata.name, metadata.versions, metadata.platform) == ("ctr", ["1"], "pytorch")
    assert [(t.name, t.datatype, t.shape) for t in metadata.inputs] == [
        ("dense_features", "FP32", [-1, 13]),
        ("sparse_features", "INT64", [-1, 26, -1]),
    ]
    assert [(t.name, t.datatype, t.shape) for t in metadata.outputs] == [("probabilities", "FP32", [-1, 1])]


def test_dlrm_id_ranges_of_the_fakes_are_what_the_model_graph_gives() -> None:
    from disagg.id_ranges import id_ranges
    from disagg.model import build_preset
    from disagg.partition import embedding_lookups, partition_embeddings

    lookups = embedding_lookups(partition_embeddings(build_preset("tiny", device="meta")))
    [(name, found)] = id_ranges(lookups, SIGNATURE).items()
    expected = ID_RANGES[name]
    assert found.low == expected.low
    assert np.array_equal(found.high, expected.high) and np.array_equal(found.tables, expected.tables)


# --- a user model: user INT64 [-1], history INT64 [-1, -1] (forward argument `items`) -----------------------------

USER_LIMITS = DLRMLimits(max_rows_per_request=MAX_ROWS, max_ids_per_feature=MAX_IDS)
USERS_SEEN = np.array([3, 0, USERS - 1], dtype=np.int64)
HISTORY = np.array([[1, 2, 3, 4], [0, 0, 0, 0], [ITEMS - 1, 7, 0, 5]], dtype=np.int64)


def user_body(user: np.ndarray = USERS_SEEN, history: np.ndarray = HISTORY, **fields: Any) -> dict[str, Any]:
    tensors = {"user": torch.from_numpy(user), "history": torch.from_numpy(history)}
    return encode_infer_request(tensors, request_id="u-1").model_dump(exclude_none=True) | fields


def decode_user(body: dict[str, Any], binary_inputs=None) -> dict[str, torch.Tensor]:
    return decode_infer_inputs(InferRequest.model_validate(body), USER_SIGNATURE, USER_ID_RANGES, USER_LIMITS,
                               binary_inputs)


def test_user_model_json_inputs_are_keyed_by_forward_argument() -> None:
    inputs = decode_user(user_body())
    assert list(inputs) == ["user", "items"]
    assert inputs["user"].dtype == inputs["items"].dtype == torch.int64
    assert np.array_equal(inputs["user"].numpy(), USERS_SEEN) and np.array_equal(inputs["items"].numpy(), HISTORY)


def test_user_model_binary_inputs_with_int32_ids_are_widened() -> None:
    body = user_body()
    for tensor in body["inputs"]:
        tensor |= {"datatype": "INT32"}
        del tensor["data"]
    inputs = decode_user(body, [USERS_SEEN.astype("<i4"), HISTORY.astype("<i4")])
    assert inputs["user"].dtype == inputs["items"].dtype == torch.int64
    assert np.array_equal(inputs["user"].numpy(), USERS_SEEN) and np.array_equal(inputs["items"].numpy(), HISTORY)


def test_json_int32_ids_are_widened() -> None:
    body = user_body()
    body["inputs"][1]["datatype"] = "INT32"
    assert decode_user(body)["items"].dtype == torch.int64


def test_a_left_out_trailing_variable_dimension_is_one() -> None:
    inputs = decode_user(user_body(history=HISTORY[:, 0]))
    assert inputs["items"].shape == (3, 1) and np.array_equal(inputs["items"].numpy()[:, 0], HISTORY[:, 0])


def test_history_lengths_may_differ_between_requests() -> None:
    assert decode_user(user_body(history=HISTORY[:, :2]))["items"].shape == (3, 2)
    assert decode_user(user_body(history=np.zeros((3, MAX_IDS), np.int64)))["items"].shape == (3, MAX_IDS)


def set_user_input(index: int, **fields: Any) -> Callable[[dict], None]:
    def mutate(body: dict) -> None:
        body["inputs"][index] |= fields

    return mutate


USER_ERROR_CASES = {
    "unknown input": (
        lambda body: body["inputs"].append({"name": "age", "shape": [3], "datatype": "INT64", "data": [1, 2, 3]}),
        "inputs[2].name",
        "unknown input 'age'; expected 'user' and 'history'",
    ),
    "input named by forward argument": (
        set_user_input(1, name="items"), "inputs[1].name", "unknown input 'items'; expected 'user' and 'history'"
    ),
    "duplicate input": (lambda body: body["inputs"].append(body["inputs"][0]), "inputs[2].name", "duplicate input"),
    "missing input": (lambda body: body["inputs"].pop(0), "inputs", "missing input 'user'; expected 'user' and"),
    "float ids": (set_user_input(0, datatype="FP32"), "inputs[0].datatype", "user must be INT64 or INT32, got FP32"),
    "user rank": (
        set_user_input(0, shape=[3, 1]), "inputs[0].shape", "user must have shape [-1] (-1: any number of rows)"
    ),
    "history rank": (
        set_user_input(1, shape=[3, 2, 2]), "inputs[1].shape", "must have shape [-1, -1] or [-1] (-1: any size)"
    ),
    "history too long": (
        set_user_input(1, shape=[1, MAX_IDS + 1], data=[0] * (MAX_IDS + 1)),
        "inputs[1].shape",
        f"history has {MAX_IDS + 1} values along dimension 1, over the limit of {MAX_IDS}",
    ),
    "empty history": (set_user_input(1, shape=[3, 0], data=[]), "inputs[1].shape", "history has no values along"),
    "row count mismatch": (
        set_user_input(1, shape=[2, 4]), "inputs[1].shape", "history has 2 rows but user has 3"
    ),
    "user id past its table": (
        set_user_input(0, data=[1, USERS, 2]),
        "inputs[0].data",
        f"id {USERS} in row 1 is out of range for table users (valid ids 0..{USERS - 1}; 1 id(s) out of range)",
    ),
    "negative item id": (
        set_user_input(1, data=[0, 0, 0, 0, 0, -1, 0, -5, *[0] * 4]),
        "inputs[1].data",
        f"id -1 in row 1, position 1 is out of range for table items (valid ids 0..{ITEMS - 1}; 2 id(s) out",
    ),
    "int32 id beyond int32": (
        set_user_input(0, datatype="INT32", data=[1, 2**31, 2]), "inputs[0].data", "integers in the INT32 range"
    ),
    "int64 id beyond int64": (set_user_input(0, data=[1, 2**63, 2]), "inputs[0].data", "integers in the INT64 range"),
    "unknown output": (
        lambda body: body.update(outputs=[{"name": "probabilities"}]),
        "outputs[0].name",
        "unknown output 'probabilities'; this model has 'score' and 'embedding'",
    ),
}


@pytest.mark.parametrize("case", USER_ERROR_CASES, ids=list(USER_ERROR_CASES))
def test_bad_user_model_input_is_a_400_naming_the_field(case: str) -> None:
    mutate, param, message = USER_ERROR_CASES[case]
    body = user_body()
    mutate(body)
    with pytest.raises(APIError) as raised:
        decode_user(body)
    assert (raised.value.status_code, raised.value.param) == (400, param)
    assert raised.value.message.startswith(f"{param}: ") and message in raised.value.message, raised.value.message


@pytest.mark.parametrize("which", [0, 1])
def test_too_many_user_rows_is_413_naming_the_shape(which: int) -> None:
    rows = MAX_ROWS + 1
    body = user_body(np.zeros(rows, np.int64), np.zeros((rows, 2), np.int64))
    body["inputs"][1 - which]["shape"][0] = 1  # only input `which` is over the limit (its rows are checked first)
    body["inputs"] = [body["inputs"][which], body["inputs"][1 - which]]
    with pytest.raises(APIError) as raised:
        decode_user(body)
    assert (raised.value.status_code, raised.value.param) == (413, "inputs[0].shape")
    assert f"{rows} rows exceed the limit of {MAX_ROWS} rows per request" in raised.value.message


def test_binary_ids_are_range_checked_with_their_table() -> None:
    body = user_body()
    del body["inputs"][1]["data"]
    history = HISTORY.copy()
    history[2, 3] = ITEMS
    with pytest.raises(APIError, match=rf"^inputs\[1\]\.data: id {ITEMS} in row 2, position 3 .* table items"):
        decode_user(body, [None, history])


def test_an_input_without_an_id_range_takes_any_id() -> None:
    inputs = decode_infer_inputs(InferRequest.model_validate(user_body(user=np.array([5, 10**12, -3]))),
                                 USER_SIGNATURE, {}, USER_LIMITS)
    assert inputs["user"].tolist() == [5, 10**12, -3]


def test_positions_of_no_table_take_any_non_negative_id() -> None:
    """Where the graph leaves a position without a table, its high is the int64 maximum and only low applies."""
    unmapped = {"user": IdRange(0, np.array([np.iinfo(np.int64).max]), np.array([None], dtype=object))}
    request = InferRequest.model_validate(user_body(user=np.array([5, 10**12, 0])))
    assert decode_infer_inputs(request, USER_SIGNATURE, unmapped, USER_LIMITS)["user"].tolist() == [5, 10**12, 0]
    request = InferRequest.model_validate(user_body(user=np.array([5, -1, 0])))
    with pytest.raises(APIError, match=r"id -1 in row 1 is out of range \(valid ids 0 or more; 1 id"):
        decode_infer_inputs(request, USER_SIGNATURE, unmapped, USER_LIMITS)


def user_outputs(rows: int = 3) -> list[torch.Tensor]:
    """The backend's outputs in signature order, float64 (the API sends each as its signature's FP32)."""
    return [torch.arange(rows, dtype=torch.float64).reshape(rows, 1) / 4,
            torch.arange(rows * 8, dtype=torch.float64).reshape(rows, 8)]


def test_all_outputs_are_sent_in_signature_order_as_their_datatype() -> None:
    response = encode_outputs(user_outputs(), USER_SIGNATURE, requested=None, model_name="m", model_version="1",
                              request_id=None)
    assert [(o.name, o.datatype, o.shape) for o in response.outputs] == [
        ("score", "FP32", [3, 1]), ("embedding", "FP32", [3, 8])
    ]
    assert response.outputs[0].data == [0.0, 0.25, 0.5] and response.outputs[1].data == list(range(24))


def test_only_the_requested_outputs_are_sent_in_the_requests_order() -> None:
    requested = [RequestedOutput(name="embedding")]
    [output] = encode_outputs(user_outputs(), USER_SIGNATURE, requested=requested, model_name="m",
                              model_version="1", request_id="u-1").outputs
    assert (output.name, output.shape) == ("embedding", [3, 8])
    both = [RequestedOutput(name="embedding"), RequestedOutput(name="score")]
    response = encode_outputs(user_outputs(), USER_SIGNATURE, requested=both, model_name="m", model_version="1",
                              request_id="u-1")
    assert [output.name for output in response.outputs] == ["embedding", "score"]


def test_requesting_a_subset_of_outputs_decodes() -> None:
    assert list(decode_user(user_body(outputs=[{"name": "embedding"}]))) == ["user", "items"]


def test_user_model_metadata() -> None:
    metadata = model_metadata("recs", "1", USER_SIGNATURE)
    assert [(t.name, t.datatype, t.shape) for t in metadata.inputs] == [("user", "INT64", [-1]),
                                                                         ("history", "INT64", [-1, -1])]
    assert [(t.name, t.datatype, t.shape) for t in metadata.outputs] == [("score", "FP32", [-1, 1]),
                                                                          ("embedding", "FP32", [-1, 8])]


# --- BOOL, FP16, FP64 and INT32 inputs ---------------------------------------------------------------------------

MIXED = ModelSignature(
    inputs=[
        InputSignature(name="flags", datatype="BOOL", shape=[-1, 2]),
        InputSignature(name="weights", datatype="FP16", shape=[-1, -1]),
        InputSignature(name="counts", datatype="INT32", shape=[-1, 1]),
        InputSignature(name="prices", datatype="FP64", shape=[-1]),
    ],
    outputs=[OutputSignature(name="out", datatype="FP64", shape=[-1, 1])],
)


def mixed_body(**changes: dict[str, Any]) -> dict[str, Any]:
    inputs = {
        "flags": {"shape": [2, 2], "datatype": "BOOL", "data": [True, False, 1, 0]},
        "weights": {"shape": [2, 3], "datatype": "FP16", "data": [0.5, 1, 2, 3, 4, 65504]},
        "counts": {"shape": [2, 1], "datatype": "INT32", "data": [7, -8]},
        "prices": {"shape": [2], "datatype": "FP64", "data": [1e300, 0.1]},
    }
    return {"inputs": [{"name": name, **tensor, **changes.get(name, {})} for name, tensor in inputs.items()]}


def decode_mixed(body: dict[str, Any], binary_inputs=None) -> dict[str, torch.Tensor]:
    return decode_infer_inputs(InferRequest.model_validate(body), MIXED, {}, LIMITS, binary_inputs)


def test_each_input_is_decoded_to_its_signature_datatype() -> None:
    inputs = decode_mixed(mixed_body())
    assert {name: tensor.dtype for name, tensor in inputs.items()} == {
        "flags": torch.bool, "weights": torch.float16, "counts": torch.int32, "prices": torch.float64
    }
    assert inputs["flags"].tolist() == [[True, False], [True, False]]
    assert inputs["weights"][1, 2] == 65504 and inputs["counts"].tolist() == [[7], [-8]]
    assert inputs["prices"].tolist() == [1e300, 0.1]


def test_binary_bool_and_fp16_inputs() -> None:
    body = mixed_body()
    for tensor in body["inputs"][:2]:
        del tensor["data"]
    flags = np.array([[True, False], [False, True]])
    weights = np.array([[0.5, 1, 2], [3, 4, 5]], dtype="<f2")
    inputs = decode_mixed(body, [flags, weights, None, None])
    assert inputs["flags"].tolist() == flags.tolist() and np.array_equal(inputs["weights"].numpy(), weights)
    with pytest.raises(APIError, match=r"^inputs\[0\]\.data: flags data must be true/false or 0/1"):
        decode_mixed(body, [np.frombuffer(b"\x01\x02\x00\x00", "?").reshape(2, 2), weights, None, None])


MIXED_ERROR_CASES = {
    "bool 2": ({"flags": {"data": [True, 2, 0, 0]}}, "inputs[0].data", "flags data must be true/false or 0/1"),
    "bool float": ({"flags": {"data": [1.0, 0, 0, 0]}}, "inputs[0].data", "must be true/false or 0/1"),
    "bool as int": ({"flags": {"datatype": "INT64"}}, "inputs[0].datatype", "flags must be BOOL, got INT64"),
    "fp16 overflow": (
        {"weights": {"data": [0.5, 1, 2, 3, 4, 1e5]}},
        "inputs[1].data",
        "weights value inf at row 1, position 2 is not a finite FP16 number (1 such value(s))",
    ),
    "fp16 sent as fp32": ({"weights": {"datatype": "FP32"}}, "inputs[1].datatype", "weights must be FP16, got FP32"),
    "int32 sent as int64": ({"counts": {"datatype": "INT64"}}, "inputs[2].datatype", "counts must be INT32, got"),
    "int32 overflow": ({"counts": {"data": [7, 2**31]}}, "inputs[2].data", "integers in the INT32 range"),
    "fixed dimension": ({"counts": {"shape": [1, 2]}}, "inputs[2].shape", "counts needs 1 values along dimension 1"),
    "no omitted fixed dimension": ({"counts": {"shape": [2]}}, "inputs[2].shape", "must have shape [-1, 1] (-1: any "
                                   "number of rows), got [2]"),
    "fp64 overflow": ({"prices": {"data": [1e300, 1e309]}}, "inputs[3].data", "value inf at row 1 is not a finite"),
    "booleans as numbers": ({"prices": {"data": [True, False]}}, "inputs[3].data", "prices data must be numbers"),
}


@pytest.mark.parametrize("case", MIXED_ERROR_CASES, ids=list(MIXED_ERROR_CASES))
def test_bad_typed_input_is_a_400_naming_the_field(case: str) -> None:
    changes, param, message = MIXED_ERROR_CASES[case]
    with pytest.raises(APIError) as raised:
        decode_mixed(mixed_body(**changes))
    assert (raised.value.status_code, raised.value.param) == (400, param)
    assert message in raised.value.message, raised.value.message


def test_client_request_takes_each_datatype_from_the_tensor() -> None:
    request = encode_infer_request({
        "a": torch.tensor([[True, False]]), "b": torch.tensor([[1, 2]], dtype=torch.int32),
        "c": torch.tensor([0.5], dtype=torch.float16), "d": torch.tensor([[3]]), "e": torch.tensor([1.5]),
    }, request_id="x")  # fmt: skip
    assert request.id == "x"
    assert [(t.name, t.datatype, t.shape, t.data) for t in request.inputs] == [
        ("a", "BOOL", [1, 2], [True, False]), ("b", "INT32", [1, 2], [1, 2]), ("c", "FP16", [1], [0.5]),
        ("d", "INT64", [1, 1], [3]), ("e", "FP32", [1], [1.5]),
    ]  # fmt: skip
    with pytest.raises(ValueError, match=r"input 'x': no OIP datatype for torch\.bfloat16"):
        encode_infer_request({"x": torch.zeros(1, dtype=torch.bfloat16)})
