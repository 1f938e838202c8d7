"""id_ranges: the table each position of an integer input indexes, read from the model's graph."""

import numpy as np
import pytest
import torch
from torch import nn

from disagg.examples import dcn_v2, deepfm, two_tower
from disagg.id_ranges import id_ranges
from disagg.model_check import check_model
from disagg.partition import embedding_lookups, partition_embeddings
from disagg.signature import InputSignature, ModelSignature
from disagg.spec import preset_spec
from tests.helpers.user_models import example_config

TINY_ROWS = preset_spec("tiny").table_sizes

#: Per example and integer input: (low, the table of each position, its rows), positions over the input's shape
#: with 1 along the batch and the variable dimensions.
EXPECTED = {
    "dlrm": {"sparse_features": (-1, [[[f"embeddings.{t}"] for t in range(26)]], [[[rows] for rows in TINY_ROWS]])},
    "dcn_v2": {"categorical": (-1, [[[f"bags.{f}"] for f in range(3)]], [[[rows] for rows in dcn_v2.TABLE_ROWS]])},
    "deepfm": {"fields": (0, [[f"vectors.{f}" for f in range(4)]], [list(deepfm.FIELD_ROWS)])},  # the first of a tie
    "two_tower": {
        "user_id": (0, ["users"], [two_tower.USERS]),
        "history": (0, [["history"]], [[two_tower.ITEMS]]),
        "item_id": (0, ["items"], [two_tower.ITEMS]),
    },
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_example_input_maps_its_positions_to_their_tables(name):
    report = check_model(example_config(name))
    assert report.id_ranges.keys() == EXPECTED[name].keys()  # float inputs get none
    for tensor, (low, tables, high) in EXPECTED[name].items():
        found = report.id_ranges[tensor]
        assert found.low == low, tensor
        assert found.tables.tolist() == tables, tensor
        assert found.high.tolist() == high, tensor
        assert all(report.tables[table][0] == rows for table, rows in zip(found.tables.flat, found.high.flat,
                                                                           strict=True))


class Routed(nn.Module):
    """``ids`` position 0 feeds ``a`` (50 rows) and ``b`` (100), position 1 ``b`` and, offset by 7, ``a``,
    position 2 ``b``; ``hashed`` reaches ``c`` modulo its rows; ``bag`` feeds ``a`` its first id, ``b`` all."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Embedding(50, 2), nn.Embedding(100, 2), nn.Embedding(30, 2)
        self.bag_a, self.bag_b = nn.EmbeddingBag(50, 2), nn.EmbeddingBag(100, 2)

    def forward(self, ids: torch.Tensor, hashed: torch.Tensor, bag: torch.Tensor) -> torch.Tensor:
        return (self.a(ids[:, 0]) + self.b(ids[:, 0]) + self.b(ids[:, 1]) + self.a(ids[:, 1] + 7) + self.b(ids[:, 2])
                + self.c(hashed % 30) + self.bag_a(bag[:, :1]) + self.bag_b(bag))


ROUTED = ModelSignature(inputs=[
    InputSignature(name="ids", datatype="INT64", shape=[-1, 3]),
    InputSignature(name="hashed", datatype="INT32", shape=[-1]),
    InputSignature(name="bag", datatype="INT64", shape=[-1, -1]),
])


@pytest.fixture(scope="module")
def routed() -> dict:
    return id_ranges(embedding_lookups(partition_embeddings(Routed())), ROUTED)


def test_a_position_feeding_two_tables_takes_the_smaller_and_an_offset_lookup_none(routed):
    ids = routed["ids"]
    # position 1 also reaches `a` as id + 7, which one probe alone would read as position 2 feeding `a`
    assert ids.tables.tolist() == [["a", "b", "b"]]
    assert ids.high.tolist() == [[50, 100, 100]]
    assert ids.low == 0  # -1 reaches the lookups as -1


def test_hashed_ids_get_no_range(routed):
    assert "hashed" not in routed


def test_a_variable_dimension_folds_to_its_smallest_table(routed):
    bag = routed["bag"]
    assert bag.tables.shape == bag.high.shape == (1, 1)
    assert (bag.tables[0, 0], int(bag.high[0, 0])) == ("bag_a", 50)
    assert bag.high.dtype == np.int64
