"""`autoconfig evaluate` on a synthetic bank: the table, the plot, and refusals."""

import pytest

from autoconfig.bank import save_bank
from autoconfig.cli import main
from autoconfig.space import SearchSpace
from tests.helpers.surfaces import synthetic_bank

SPACE = SearchSpace.parse({"knobs": {
    "max_batch_size": {"values": [1, 4, 16]},
    "batch_wait_timeout_s": {"values": [0.0, 0.01]},
    "device_share": {"values": [0.5, 1.0]},
    "num_replicas": {"values": [1, 2]},
}})


def test_evaluate_prints_each_searcher_and_writes_a_png(tmp_path, capsys):
    save_bank(synthetic_bank(3, SPACE, seed=5), tmp_path / "bank")
    plot = tmp_path / "replay.png"
    assert main(["evaluate", "--bank", str(tmp_path / "bank"), "--searchers", "grid,random",
                 "--seeds", "2", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "grid" in out and "random" in out and "3 held-out models x 2 seeds" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("field", "where"), [("code", "at 2 code versions"), ("machine", "on 2 machines")])
def test_evaluate_warns_when_the_bank_was_measured_at_several_code_versions_or_machines(tmp_path, capsys, field,
                                                                                         where):
    entries = synthetic_bank(3, SPACE, seed=5)
    recorded = [entry.model_copy(update={"trials": [trial.model_copy(update={field: measurer})
                                                    for trial in entry.trials]})
                for entry, measurer in zip(entries, ["abc", "abc", None], strict=True)]
    save_bank(recorded, tmp_path / "mixed")
    assert main(["evaluate", "--bank", str(tmp_path / "mixed"), "--searchers", "grid", "--seeds", "1",
                 "--plot", str(tmp_path / "p.png")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    names = [entry.name for entry in entries]
    assert f"measured {where}, so" in out and f"abc: {names[0]}, {names[1]}; not recorded: {names[2]}" in out
    assert out.count("warning:") == 1  # the other provenance is the same (unrecorded) for all three
    save_bank(recorded[:2], tmp_path / "one")
    assert main(["evaluate", "--bank", str(tmp_path / "one"), "--searchers", "grid", "--seeds", "1",
                 "--plot", str(tmp_path / "p.png")]) == 0
    assert "warning:" not in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--searchers", "random,annealing"], "unknown searcher(s) annealing"),
    (["--seeds", "1"], "at least 2 profiled models"),
])
def test_evaluate_refuses_unknown_searchers_and_a_one_model_bank(tmp_path, capsys, argv, message):
    entries = synthetic_bank(3, SPACE, seed=5)
    save_bank(entries if "--searchers" in argv else entries[:1], tmp_path)
    assert main(["evaluate", "--bank", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().out
