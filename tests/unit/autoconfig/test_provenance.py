"""What measured a trial: the checkout's commit (or the installed version without one), and the hardware."""

import os
import subprocess

import pytest

from autoconfig import provenance
from tests.helpers import REPO


@pytest.fixture(autouse=True)
def _fresh_cache():
    provenance.code_version.cache_clear()
    provenance.machine_id.cache_clear()
    yield
    provenance.code_version.cache_clear()
    provenance.machine_id.cache_clear()


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


def test_the_cpu_model_is_read_from_cpuinfo_and_the_architecture_stands_in_without_it(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 7B13\n")
    monkeypatch.setattr(provenance, "_CPUINFO", cpuinfo)
    assert provenance.cpu_model() == "AMD EPYC 7B13"
    monkeypatch.setattr(provenance, "_CPUINFO", tmp_path / "absent")  # not Linux
    monkeypatch.setattr(provenance.platform, "processor", lambda: "")
    monkeypatch.setattr(provenance.platform, "machine", lambda: "arm64")
    assert provenance.cpu_model() == "arm64"


def test_the_machine_names_the_cpu_model_and_count_and_the_gpu_where_there_is_one(tmp_path, monkeypatch):
    import torch

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("model name\t: Intel(R) Xeon(R) Processor\n")
    monkeypatch.setattr(provenance, "_CPUINFO", cpuinfo)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert provenance.machine_id() == f"Intel(R) Xeon(R) Processor x{os.cpu_count()}"
    provenance.machine_id.cache_clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"NVIDIA H200 #{index}")
    assert provenance.machine_id() == f"Intel(R) Xeon(R) Processor x{os.cpu_count()}, NVIDIA H200 #0"
