"""OIP v2 <-> DLRM tensor conversion: happy paths and every refusal, naming the client's field."""

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from disagg.api.codec import decode_dlrm_request, dlrm_model_metadata, encode_dlrm_request, encode_dlrm_response
from disagg.api.protocol import InferRequest
from disagg.config import DLRMLimits
from disagg.spec import preset_spec
from serving.common.errors import APIError

SPEC = preset_spec("tiny")
MAX_ROWS = 8
MAX_IDS = 4
LIMITS = DLRMLimits(max_rows_per_request=MAX_ROWS, max_ids_per_feature=MAX_IDS)


def valid_tensors(rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    dense = torch.arange(rows * SPEC.num_dense, dtype=torch.float32).reshape(rows, SPEC.num_dense) / 7
    sparse = torch.tensor(
        [[(row + table) % size for table, size in enumerate(SPEC.table_sizes)] for row in range(rows)]
    )
    return dense, sparse


def valid_body(rows: int = 3) -> dict[str, Any]:
    return encode_dlrm_request(*valid_tensors(rows), request_id="r-1").model_dump(exclude_none=True)


def multi_hot(rows: int = 3, ids: int = MAX_IDS) -> torch.Tensor:
    """[rows, tables, ids]: row r holds r + 1 valid ids per table (capped at ``ids``), then -1 padding."""
    sparse = torch.full((rows, SPEC.num_tables, ids), -1)
    for row in range(rows):
        for slot in range(min(row + 1, ids)):
            sparse[row, :, slot] = torch.tensor([(row + slot) % size for size in SPEC.table_sizes])
    return sparse


def decode(body: dict[str, Any], binary_inputs=None):
    return decode_dlrm_request(InferRequest.model_validate(body), SPEC, LIMITS, binary_inputs)


def test_round_trip_gives_back_one_hot_ids_as_bags_of_one() -> None:
    dense, sparse = valid_tensors()
    inputs = decode(valid_body())
    assert inputs.dense.dtype == torch.float32 and inputs.sparse.dtype == torch.int64
    assert torch.equal(inputs.dense, dense)
    assert inputs.sparse.shape == (3, SPEC.num_tables, 1)
    assert torch.equal(inputs.sparse[:, :, 0], sparse)


def test_multi_hot_ids_with_empty_slots_pass_unchanged() -> None:
    dense, sparse = valid_tensors()[0], multi_hot()
    inputs = decode(encode_dlrm_request(dense, sparse).model_dump(exclude_none=True))
    assert torch.equal(inputs.sparse, sparse)
    assert inputs.sparse.dtype == torch.int64


def test_empty_slot_is_valid_in_one_hot_input_too() -> None:
    body = valid_body()
    body["inputs"][1]["data"][0] = -1
    assert decode(body).sparse[0, 0, 0] == -1


def test_binary_inputs_replace_json_data() -> None:
    dense, sparse = valid_tensors()[0], multi_hot()
    body = encode_dlrm_request(dense, sparse).model_dump(exclude_none=True)
    body["inputs"][1]["datatype"] = "INT32"
    for tensor in body["inputs"]:
        del tensor["data"]
    inputs = decode(body, [dense.numpy().astype("<f4"), sparse.numpy().astype("<i4")])
    assert torch.equal(inputs.dense, dense)
    assert torch.equal(inputs.sparse, sparse) and inputs.sparse.dtype == torch.int64


def test_non_finite_binary_dense_value_is_refused() -> None:
    dense, sparse = valid_tensors()
    dense[2, 4] = float("inf")
    body = encode_dlrm_request(dense, sparse).model_dump(exclude_none=True)
    del body["inputs"][0]["data"]
    with pytest.raises(APIError, match=r"value inf at row 2, feature 4 is not a finite"):
        decode(body, [dense.numpy(), None])


def test_nested_data_inputs_in_any_order_and_int32_ids_are_accepted() -> None:
    dense, sparse = valid_tensors()
    body = valid_body()
    body["inputs"].reverse()
    body["inputs"][0] |= {"datatype": "INT32", "data": sparse.tolist()}
    body["inputs"][1]["data"] = dense.tolist()
    inputs = decode(body)
    assert torch.equal(inputs.dense, dense)
    assert torch.equal(inputs.sparse, sparse.unsqueeze(2))
    assert inputs.sparse.dtype == torch.int64


def test_integer_json_values_are_valid_fp32() -> None:
    body = valid_body(rows=1)
    body["inputs"][0]["data"] = list(range(SPEC.num_dense))
    assert decode(body).dense.tolist() == [[float(i) for i in range(SPEC.num_dense)]]


def test_requesting_the_probabilities_output_by_name_is_accepted() -> None:
    body = valid_body() | {"outputs": [{"name": "probabilities"}]}
    assert decode(body).dense.shape == (3, SPEC.num_dense)


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
    "missing input": (lambda body: body["inputs"].pop(1), "inputs", "missing input 'sparse_features'"),
    "unknown input": (
        lambda body: body["inputs"].append(dict(body["inputs"][0], name="user_age")),
        "inputs[2].name",
        "unknown input 'user_age'",
    ),
    "duplicate input": (
        lambda body: body["inputs"].append(dict(body["inputs"][0])),
        "inputs[2].name",
        "duplicate input 'dense_features'",
    ),
    "dense datatype": (set_at(("inputs", 0, "datatype"), "FP64"), "inputs[0].datatype", "must be FP32"),
    "sparse datatype": (set_at(("inputs", 1, "datatype"), "FP32"), "inputs[1].datatype", "must be INT64 or INT32"),
    "rank": (reshape(0, [39]), "inputs[0].shape", "must have shape [batch, 13]"),
    "sparse rank": (reshape(1, [3, 26, 1, 1]), "inputs[1].shape", "must have shape [batch, 26] or [batch, 26, "),
    "dense feature count": (reshape(0, [3, 12]), "inputs[0].shape", "needs 13 dense features per row, got 12"),
    "table count": (reshape(1, [3, 25]), "inputs[1].shape", "needs 26 sparse features (one per table) per row"),
    "multi-hot table count": (reshape(1, [3, 25, 2]), "inputs[1].shape", "needs 26 sparse features"),
    "too many ids per table": (
        set_multi_hot(MAX_IDS + 1),
        "inputs[1].shape",
        f"5 ids per table exceed the limit of {MAX_IDS}",
    ),
    "no id slots": (reshape(1, [3, 26, 0]), "inputs[1].shape", "has no id slots"),
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
        "id 1000 in row 1 is out of range for table 3 (valid ids 0..999",
    ),
    "negative id": (set_value(1, 26 + TABLE_3, -2), "inputs[1].data", "id -2 in row 1 is out of range for table 3"),
    "id past table end in a bag": (
        set_multi_hot(2, at=(2, TABLE_3, 1), value=1000),
        "inputs[1].data",
        "id 1000 in row 2 is out of range for table 3 (valid ids 0..999, or -1",
    ),
    "negative id in a bag": (
        set_multi_hot(2, at=(0, 5, 1), value=-7),
        "inputs[1].data",
        "id -7 in row 0 is out of range for table 5",
    ),
    "float id": (set_value(1, 0, 1.5), "inputs[1].data", "must be integers"),
    "huge id": (set_value(1, 0, 2**70), "inputs[1].data", "must be integers"),
    "nan": (set_value(0, 14, float("nan")), "inputs[0].data", "value nan at row 1, feature 1 is not a finite"),
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
        "unknown output 'logits'",
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
    with pytest.raises(APIError, match=r"table 0 .*3 id\(s\) out of range"):
        decode(body)


def test_response_carries_flat_fp32_probabilities_and_the_request_id() -> None:
    probabilities = torch.tensor([[0.25], [0.5], [0.125]])
    response = encode_dlrm_response(probabilities, model_name="dlrm", model_version="1", request_id="r-1")
    assert (response.model_name, response.model_version, response.id) == ("dlrm", "1", "r-1")
    [output] = response.outputs
    assert (output.name, output.datatype, output.shape) == ("probabilities", "FP32", [3, 1])
    assert output.data == [0.25, 0.5, 0.125]


def test_model_metadata_describes_the_inputs_of_the_spec() -> None:
    metadata = dlrm_model_metadata("ctr", "1", SPEC)
    assert metadata.name == "ctr" and metadata.versions == ["1"]
    assert [(t.name, t.datatype, t.shape) for t in metadata.inputs] == [
        ("dense_features", "FP32", [-1, 13]),
        ("sparse_features", "INT64", [-1, 26, -1]),
    ]
    assert [(t.name, t.datatype, t.shape) for t in metadata.outputs] == [("probabilities", "FP32", [-1, 1])]
