"""Where a result says it came from: the commit, dirty only when code changed."""

import json
import subprocess

import pytest

from benchmarks.records import provenance, write_results


@pytest.fixture
def repo(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "old.json").write_text("{}")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    return tmp_path


def test_results_written_into_the_tree_leave_the_commit_clean(repo):
    (repo / "benchmarks" / "results" / "old.json").write_text('{"new": 1}')
    (repo / "benchmarks" / "results" / "another.json").write_text("{}")
    commit = provenance(repo)["commit"]
    assert len(commit) == 40 and not commit.endswith("-dirty")


def test_a_changed_or_new_file_outside_the_results_makes_it_dirty(repo):
    (repo / "code.py").write_text("x = 2\n")
    assert provenance(repo)["commit"].endswith("-dirty")
    (repo / "code.py").write_text("x = 1\n")
    (repo / "new.py").write_text("")
    assert provenance(repo)["commit"].endswith("-dirty")


def test_results_write_paths_as_text_and_refuse_what_json_does_not_know(tmp_path):
    write_results("r", {"args": {"out": tmp_path / "x"}}, "table", tmp_path)
    assert json.loads((tmp_path / "r.json").read_text()) == {"args": {"out": str(tmp_path / "x")}}
    with pytest.raises(TypeError, match="set is not JSON serializable"):
        write_results("bad", {"ids": {1, 2}}, "table", tmp_path)
