"""Reduced precision on the trained tiny DLRM: int8 / float16 tables and half-precision rows on the wire keep the
held-out AUC within 0.002 of float32 (the issue's bound), while actually changing the predictions."""

import pytest

from training.precision import precision_auc

MAX_AUC_CHANGE = 0.002


@pytest.fixture(scope="module")
def report():
    return precision_auc(rows=16384)


def test_every_reduced_precision_setting_keeps_the_auc_within_the_bound(report):
    by_setting = {(entry["storage"], entry["wire"]): entry for entry in report["rows"]}
    assert by_setting["float32", "float32"]["auc_change"] == 0
    assert by_setting["float32", "float32"]["max_abs_prediction_change"] == 0
    assert by_setting["float32", "float32"]["auc"] > 0.7  # the trained model, not a random one
    for (storage, wire), entry in by_setting.items():
        assert abs(entry["auc_change"]) <= MAX_AUC_CHANGE, (storage, wire, entry)
        if (storage, wire) != ("float32", "float32"):
            assert entry["max_abs_prediction_change"] > 0, (storage, wire)  # the setting really took effect


def test_int8_tables_change_predictions_more_than_float16_tables(report):
    by_setting = {(entry["storage"], entry["wire"]): entry for entry in report["rows"]}
    int8 = by_setting["int8", "float32"]["max_abs_prediction_change"]
    assert int8 > by_setting["float16", "float32"]["max_abs_prediction_change"]
    assert report["auc_change_int8"] == by_setting["int8", "float32"]["auc_change"]
