"""Cross-request batching of the DLRM ingress: every caller gets exactly its own rows back (no Ray cluster)."""

import pytest
import torch

from disagg.deployments.ingress import merge_requests, split_rows
from disagg.model import build_preset


def request(rows: int, marker: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose every value is ``marker``, so a row's owner is visible after merging."""
    return torch.full((rows, 13), float(marker)), torch.full((rows, 26, 1), marker, dtype=torch.int64)


def test_merge_concatenates_in_request_order_and_records_row_counts() -> None:
    merged = merge_requests([request(1, 1), request(3, 2), request(2, 3)])
    assert merged.row_counts == [1, 3, 2]
    assert merged.dense[:, 0].tolist() == [1.0, 2.0, 2.0, 2.0, 3.0, 3.0]
    assert merged.sparse[:, 0, 0].tolist() == [1, 2, 2, 2, 3, 3]


def test_merge_pads_bags_to_the_largest_hotness_with_empty_slots() -> None:
    one_hot = torch.ones(2, 26, 1, dtype=torch.int64)
    multi_hot = torch.full((1, 26, 3), 2, dtype=torch.int64)
    merged = merge_requests([(torch.zeros(2, 13), one_hot), (torch.zeros(1, 13), multi_hot)])
    assert merged.sparse.shape == (3, 26, 3)
    assert merged.sparse[0, 0].tolist() == [1, -1, -1]
    assert merged.sparse[2, 0].tolist() == [2, 2, 2]


def test_split_hands_each_request_its_rows() -> None:
    outputs = torch.arange(6, dtype=torch.float32).reshape(6, 1)
    parts = split_rows(outputs, [1, 3, 2])
    assert [part.flatten().tolist() for part in parts] == [[0.0], [1.0, 2.0, 3.0], [4.0, 5.0]]


def test_split_refuses_outputs_that_do_not_match_the_requests() -> None:
    with pytest.raises(ValueError, match="5 rows but the requests hold 6"):
        split_rows(torch.zeros(5, 1), [1, 3, 2])


def test_merge_refuses_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="empty"):
        merge_requests([])


def test_batched_forward_equals_each_request_alone() -> None:
    """Mixed one-hot and multi-hot requests (different H, with empty slots) in one forward."""
    model = build_preset("tiny").eval()
    generator = torch.Generator().manual_seed(0)
    requests = [
        (torch.randn(rows, 13, generator=generator), torch.randint(-1, 3, (rows, 26, hot), generator=generator))
        for rows, hot in ((2, 1), (5, 4), (1, 2))
    ]
    merged = merge_requests(requests)
    with torch.inference_mode():
        per_request = split_rows(model(merged.dense, merged.sparse), merged.row_counts)
        for (dense, sparse), result in zip(requests, per_request, strict=True):
            assert result.shape == (dense.shape[0], 1)
            torch.testing.assert_close(result, model(dense, sparse), rtol=0, atol=1e-6)
