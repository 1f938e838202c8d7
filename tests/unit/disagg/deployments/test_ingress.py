"""Cross-request batching of the DLRM ingress: every caller gets exactly its own rows back (no Ray cluster)."""

import asyncio

import pytest
import torch

from disagg.deployments.ingress import BatchedDLRM, merge_requests, split_rows
from disagg.model import build_preset
from disagg.signature import InputSignature, ModelSignature, dlrm_signature
from serving.common.errors import APIError

DLRM = dlrm_signature(num_dense=13, num_tables=26)
#: Two inputs with variable dimensions, only ``history`` padded (with 0).
SEQUENCES = ModelSignature(inputs=[
    InputSignature(name="history", datatype="INT64", shape=[-1, -1], pad_value=0),
    InputSignature(name="tokens", datatype="INT64", shape=[-1, -1]),
])


def request(rows: int, marker: int) -> dict[str, torch.Tensor]:
    """Rows whose every value is ``marker``, so a row's owner is visible after merging."""
    return {"dense": torch.full((rows, 13), float(marker)), "sparse": torch.full((rows, 26, 1), marker)}


def test_merge_concatenates_in_request_order_and_records_row_counts() -> None:
    [merged] = merge_requests([request(1, 1), request(3, 2), request(2, 3)], DLRM)
    assert (merged.members, merged.row_counts) == ([0, 1, 2], [1, 3, 2])
    assert merged.inputs["dense"][:, 0].tolist() == [1.0, 2.0, 2.0, 2.0, 3.0, 3.0]
    assert merged.inputs["sparse"][:, 0, 0].tolist() == [1, 2, 2, 2, 3, 3]


def test_merge_pads_bags_to_the_largest_hotness_with_empty_slots() -> None:
    one_hot = {"dense": torch.zeros(2, 13), "sparse": torch.ones(2, 26, 1, dtype=torch.int64)}
    multi_hot = {"dense": torch.zeros(1, 13), "sparse": torch.full((1, 26, 3), 2, dtype=torch.int64)}
    [merged] = merge_requests([one_hot, multi_hot], DLRM)
    assert merged.inputs["sparse"].shape == (3, 26, 3)
    assert merged.inputs["sparse"][0, 0].tolist() == [1, -1, -1]
    assert merged.inputs["sparse"][2, 0].tolist() == [2, 2, 2]


def test_requests_differing_in_an_unpadded_variable_dimension_take_separate_passes() -> None:
    def sequences(rows: int, history: int, tokens: int, marker: int) -> dict[str, torch.Tensor]:
        return {"history": torch.full((rows, history), marker), "tokens": torch.full((rows, tokens), marker)}

    requests = [sequences(1, 2, 3, 1), sequences(2, 4, 5, 2), sequences(1, 1, 3, 3)]
    first, second = merge_requests(requests, SEQUENCES)
    assert (first.members, first.row_counts, second.members) == ([0, 2], [1, 1], [1])
    assert first.inputs["history"].tolist() == [[1, 1], [3, 0]]  # padded with its pad_value
    assert first.inputs["tokens"].tolist() == [[1, 1, 1], [3, 3, 3]]
    assert second.inputs["tokens"].shape == (2, 5)


def test_split_hands_each_request_its_rows_of_every_output() -> None:
    scores = torch.arange(6, dtype=torch.float32).reshape(6, 1)
    embeddings = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    parts = split_rows([scores, embeddings], [1, 3, 2])
    assert [part[0].flatten().tolist() for part in parts] == [[0.0], [1.0, 2.0, 3.0], [4.0, 5.0]]
    assert [part[1].shape[0] for part in parts] == [1, 3, 2]
    assert parts[2][1].tolist() == [[8.0, 9.0], [10.0, 11.0]]


def test_split_refuses_outputs_that_do_not_match_the_requests() -> None:
    with pytest.raises(ValueError, match="5 rows but the requests hold 6"):
        split_rows([torch.zeros(5, 1)], [1, 3, 2])


def test_merge_refuses_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="empty"):
        merge_requests([], DLRM)


def test_batched_forward_equals_each_request_alone() -> None:
    """Mixed one-hot and multi-hot requests (different H, with empty slots) in one forward."""
    model = build_preset("tiny").eval()
    generator = torch.Generator().manual_seed(0)
    requests = [
        {"dense": torch.randn(rows, 13, generator=generator),
         "sparse": torch.randint(-1, 3, (rows, 26, hot), generator=generator)}
        for rows, hot in ((2, 1), (5, 4), (1, 2))
    ]
    [merged] = merge_requests(requests, DLRM)
    with torch.inference_mode():
        per_request = split_rows([model(**merged.inputs)], merged.row_counts)
        for inputs, [result] in zip(requests, per_request, strict=True):
            assert result.shape == (inputs["dense"].shape[0], 1)
            torch.testing.assert_close(result, model(**inputs), rtol=0, atol=1e-6)


class _Refusing(BatchedDLRM):
    """The batching path without Serve: the model sums each row's ids and refuses any id over 9, as a table's
    lookup refuses an id past its rows."""

    def __init__(self) -> None:
        self.signature = SEQUENCES
        self.passes: list[int] = []

    async def _forward_batch(self, inputs):
        self.passes.append(inputs["history"].shape[0])
        if bool((inputs["history"] > 9).any()):
            raise ValueError("table 'items': id 12 is outside its rows [0, 10)")
        return inputs["history"].sum(1, keepdim=True)


def test_an_id_the_model_refuses_fails_only_the_request_that_sent_it() -> None:
    replica = _Refusing()
    good, bad, other = ({"history": torch.tensor([ids]), "tokens": torch.zeros(1, 2, dtype=torch.int64)}
                        for ids in ([1, 2], [3, 12], [4, 5]))
    first, refused, third = asyncio.run(replica._run_requests([good, bad, other]))
    assert first[0].tolist() == [[3]] and third[0].tolist() == [[9]]
    assert isinstance(refused, APIError) and refused.status_code == 400 and "id 12" in str(refused)
    assert replica.passes == [3, 1, 1, 1]  # the merged pass, then each request alone
