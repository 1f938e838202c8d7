"""Which code measured a trial: the checkout's commit, or the installed version without one."""

import subprocess

import pytest

from autoconfig import provenance
from tests.helpers import REPO


@pytest.fixture(autouse=True)
def _fresh_cache():
    provenance.code_version.cache_clear()
    yield
    provenance.code_version.cache_clear()


def test_in_a_checkout_the_code_is_its_commit():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout.strip())
    assert provenance.code_version() == head + ("-dirty" if dirty else "")


def test_local_changes_to_tracked_files_mark_the_commit_dirty(monkeypatch):
    answers = {"rev-parse": "0123abcd", "status": " M autoconfig/trial.py"}
    monkeypatch.setattr(provenance, "_git", lambda command, *args: answers[command])
    assert provenance.code_version() == "0123abcd-dirty"


def test_without_git_the_code_is_the_installed_version(monkeypatch):
    def no_git(*args):
        raise FileNotFoundError("git")

    monkeypatch.setattr(provenance, "_git", no_git)
    assert provenance.code_version() == "swiftserve 0.1.0"
    provenance.code_version.cache_clear()
    monkeypatch.setattr(provenance, "version", lambda name: (_ for _ in ()).throw(provenance.PackageNotFoundError))
    assert provenance.code_version() == "unknown"
