"""`autoconfig report`: the performance surface, the table and PNG, from a bank entry or a stored study."""

import numpy as np
import pytest
import torch

from autoconfig.bank import save_bank
from autoconfig.cli import main
from autoconfig.report import best_so_far, performance_surface, surface_axes
from autoconfig.searchers import MetaParams, meta_factory
from autoconfig.searchers.base import Observation
from autoconfig.space import Configuration, SearchSpace
from autoconfig.study import TuningStudy
from tests.helpers.surfaces import synthetic_bank

SPACE = SearchSpace.parse({"knobs": {
    "max_batch_size": {"values": [1, 4]},
    "batch_wait_timeout_s": {"values": [0.0, 0.01]},
    "device_share": {"values": [0.5, 1.0]},
    "num_replicas": {"values": [1, 2]},
}})
PNG = b"\x89PNG\r\n\x1a\n"


def _config(batch: int, wait: float, share: float, replicas: int) -> Configuration:
    return Configuration(max_batch_size=batch, batch_wait_timeout_s=wait, device_share=share, num_replicas=replicas)


def test_surface_takes_the_best_over_other_knobs_and_leaves_unobserved_cells_blank():
    history = [
        Observation(_config(4, 0.0, 0.5, 1), 10.0),
        Observation(_config(4, 0.01, 0.5, 1), 30.0),  # same cell, better wait: the cell shows 30
        Observation(_config(1, 0.0, 1.0, 2), None),  # failed: 0, not blank
    ]
    surface = performance_surface(SPACE, history)
    assert surface.rows == ((0.5, 1), (0.5, 2), (1.0, 1), (1.0, 2)) and surface.columns == (1, 4)
    assert surface.values[0, 1] == 30.0 and surface.values[3, 0] == 0.0
    assert int(np.isnan(surface.values).sum()) == 6
    assert best_so_far(history).tolist() == [10.0, 30.0, 30.0]


def test_report_of_a_bank_entry_prints_the_best_and_writes_a_png(tmp_path, capsys):
    entry = synthetic_bank(1, SPACE, seed=3)[0]
    save_bank([entry], tmp_path)
    plot = tmp_path / "report.png"
    assert main(["report", "--bank-entry", str(tmp_path / f"{entry.name}.json"), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    _, values = entry.surface()
    best = entry.space.configurations()[int(np.nanargmax(values))]
    assert f"16 trials of 16; best {best.as_dict()}" in " ".join(out.split())
    assert plot.read_bytes()[:8] == PNG


def test_report_of_a_study_lists_its_trials(tmp_path, capsys):
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    study = TuningStudy.open(storage, "dlrm-tpe", SPACE)
    study.record(_config(1, 0.0, 0.5, 1), 12.5, {"status": "ok", "sustainable_rps": 6.25, "objective": 12.5})
    study.record(_config(4, 0.0, 1.0, 2), None, {"status": "slo_violated", "sustainable_rps": 0.0})
    plot = tmp_path / "study.png"
    assert main(["report", "--study", "dlrm-tpe", "--storage", storage, "--plot", str(plot)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "slo_violated" in out and "2 trials of 16" in out and "12.50, found at trial 1" in out
    assert plot.read_bytes()[:8] == PNG


@pytest.mark.parametrize("argv", [["--study", "missing"], ["--bank-entry", "nowhere.json"]])
def test_report_refuses_a_missing_study_or_file(tmp_path, capsys, argv):
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    assert main(["report", *argv, "--storage", storage, "--plot", str(tmp_path / "x.png")]) == 2
    out = capsys.readouterr().out
    assert "error" in out and (argv[1] in out)
    assert not (tmp_path / "x.png").exists()


def test_meta_searcher_learns_only_from_profiles_over_the_same_knobs():
    threaded = SearchSpace.parse({"knobs": {**SPACE.to_dict()["knobs"], "torch_threads": {"values": [1, 2]}}})
    other_knobs = synthetic_bank(2, threaded, seed=1)
    with pytest.raises(ValueError, match="no profile in the bank is over the knobs"):
        meta_factory()(SPACE, 0, other_knobs)
    same_knobs = synthetic_bank(1, SPACE, seed=2)
    short = MetaParams(meta_iterations=5)  # the weights depend on the profiles meta-trained on, at any length
    mixed = meta_factory(short)(SPACE, 0, other_knobs + same_knobs)
    alone = meta_factory(short)(SPACE, 0, same_knobs)
    for name, weight in mixed.weights.items():  # the other-knob profiles were left out of meta-training
        assert torch.equal(weight, alone.weights[name]), name


def test_surface_axes_of_a_space_of_dotted_knobs():
    space = SearchSpace.parse({"knobs": {
        "M.user_config.mode": {"values": ["fast", "exact"]},
        "M.num_replicas": {"values": [1, 2]},
        "M.ray_actor_options.num_cpus": {"values": [0.5, 1.0]},
        "M.user_config.rows": {"values": [1, 4, 16]},
    }})
    # The knob with the most values is the column; of three others, the first with the most values is maxed over.
    assert surface_axes(space) == ("M.user_config.rows", ("M.num_replicas", "M.ray_actor_options.num_cpus"))
    config = space.configurations()[-1]  # exact, 2, 1.0, 16
    surface = performance_surface(space, [Observation(config, 3.0)])
    assert surface.rows == ((1, 0.5), (1, 1.0), (2, 0.5), (2, 1.0)) and surface.columns == (1, 4, 16)
    assert surface.values[3, 2] == 3.0 and np.isnan(surface.values).sum() == 11
