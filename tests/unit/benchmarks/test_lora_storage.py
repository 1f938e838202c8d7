"""The emulated remote LoRA storage of the benchmarks: seeded fetch times, and its hook on the LoRA cache's read."""

import json
import sys

import pytest

from benchmarks import lora_storage
from benchmarks.lora_storage import EmulatedStorage


def test_fetch_times_are_traced_latencies_over_the_compression_drawn_per_name_and_fetch():
    samples = [1000.0, 2000.0, 3000.0, 4000.0, 5000.0]
    one, other = EmulatedStorage(samples, compression=10.0, seed=3), EmulatedStorage(samples, 10.0, seed=3)
    first = [one.delay_s("a") for _ in range(20)]
    assert set(first) <= {s / 1e3 / 10 for s in samples} and len(set(first)) > 1  # each fetch draws anew
    interleaved = [other.delay_s(name) for _ in range(20) for name in ("b", "a")][1::2]
    assert interleaved == first  # the k-th fetch of a LoRA waits the same whatever else was fetched
    assert [EmulatedStorage(samples, 10.0, seed=4).delay_s("a") for _ in range(20)] != first


@pytest.fixture
def fake_cache(tmp_path, monkeypatch):
    """A stand-in for ``serving.lora.cache`` (a module with ``load_lora_file``), importable, not yet imported."""
    (tmp_path / "fake_lora_cache.py").write_text("def load_lora_file(path, **kwargs):\n    return ('read', path)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lora_storage, "CACHE_MODULE", "fake_lora_cache")
    monkeypatch.delitem(sys.modules, "fake_lora_cache", raising=False)
    monkeypatch.setattr(lora_storage, "_storage", None)
    waits = []
    monkeypatch.setattr(lora_storage, "sleep", waits.append)  # this module's name only, not time.sleep
    yield waits
    sys.modules.pop("fake_lora_cache", None)
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, lora_storage._WrapOnImport)]


def test_the_hook_puts_a_fetch_before_every_read_of_the_cache_module_imported_after_it(tmp_path, monkeypatch,
                                                                                         fake_cache):
    storage = EmulatedStorage([4000.0], compression=2.0)
    env = storage.runtime_env(tmp_path)
    assert env["worker_process_setup_hook"] == "benchmarks.lora_storage.install"
    assert str(lora_storage.REPO) in env["env_vars"]["PYTHONPATH"].split(":")
    assert json.loads((tmp_path / "lora_storage.json").read_text())["samples_ms"] == [4000.0]
    monkeypatch.setenv(lora_storage.ENV, env["env_vars"][lora_storage.ENV])
    lora_storage.install()
    assert "fake_lora_cache" not in sys.modules  # installing imports nothing
    import fake_lora_cache

    assert fake_lora_cache.load_lora_file(tmp_path / "style.safetensors", dtype=None) == (
        "read", tmp_path / "style.safetensors")
    assert fake_cache == [2.0]
    lora_storage.fetch("style")  # a baseline's own fetch
    assert fake_cache == [2.0, 2.0]


def test_without_the_environment_variable_the_hook_changes_nothing(monkeypatch, fake_cache):
    monkeypatch.delenv(lora_storage.ENV, raising=False)
    lora_storage.install()
    import fake_lora_cache

    assert fake_lora_cache.load_lora_file("x") == ("read", "x")
    lora_storage.fetch("x")
    assert fake_cache == []
