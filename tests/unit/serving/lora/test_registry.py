"""LoRA names -> files: only ``<name>.safetensors`` inside the directory, never anything else."""

from __future__ import annotations

import os

import pytest

from serving.lora import InvalidLoRAName, LoRANotFound, LoRARegistry


@pytest.fixture
def lora_dir(tmp_path):
    directory = tmp_path / "loras"
    directory.mkdir()
    for name in ("style-a", "b_2.v1", "Z"):
        (directory / f"{name}.safetensors").write_bytes(b"x")
    return directory


def test_names_lists_valid_safetensors_stems_sorted(lora_dir):
    (lora_dir / "pickled.bin").write_bytes(b"x")
    (lora_dir / "pickled.ckpt").write_bytes(b"x")
    (lora_dir / ".hidden.safetensors").write_bytes(b"x")
    (lora_dir / "has space.safetensors").write_bytes(b"x")
    (lora_dir / "-dash.safetensors").write_bytes(b"x")
    (lora_dir / "subdir.safetensors").mkdir()
    assert LoRARegistry(lora_dir).names() == ["Z", "b_2.v1", "style-a"]


def test_resolve_returns_the_real_file(lora_dir):
    registry = LoRARegistry(lora_dir)
    assert registry.resolve("style-a") == (lora_dir / "style-a.safetensors").resolve()
    assert registry.resolve("b_2.v1").name == "b_2.v1.safetensors"


def test_pickle_files_are_never_resolved(lora_dir):
    (lora_dir / "other.bin").write_bytes(b"x")
    (lora_dir / "other.ckpt").write_bytes(b"x")
    registry = LoRARegistry(lora_dir)
    with pytest.raises(LoRANotFound):
        registry.resolve("other")
    (lora_dir / "style-a.bin").write_bytes(b"x")  # same stem as a .safetensors file
    assert registry.resolve("style-a").suffix == ".safetensors"
    with pytest.raises(InvalidLoRAName):  # an extension in the name does not help
        registry.resolve("other.bin/")


@pytest.mark.parametrize("name", [
    "../x", "a/b", "..", ".", "", "/etc/passwd", "a\\b", "a\x00b", "a..b", ".hidden", "-x", "x" * 129, "a b",
    "~root", "style-a/../style-a",
])
def test_invalid_names(name, lora_dir):
    with pytest.raises(InvalidLoRAName) as info:
        LoRARegistry(lora_dir).resolve(name)
    assert info.value.name == name


def test_traversal_to_an_existing_file_is_still_invalid(lora_dir, tmp_path):
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    with pytest.raises(InvalidLoRAName):
        LoRARegistry(lora_dir).resolve("../outside")


def test_symlink_escaping_the_directory_is_not_found(lora_dir, tmp_path):
    secret = tmp_path / "secret.safetensors"
    secret.write_bytes(b"x")
    (lora_dir / "escape.safetensors").symlink_to(secret)
    (lora_dir / "dangling.safetensors").symlink_to(tmp_path / "nothing.safetensors")
    (lora_dir / "to-pickle.safetensors").symlink_to(lora_dir / "style-a.bin")
    (lora_dir / "style-a.bin").write_bytes(b"x")
    registry = LoRARegistry(lora_dir)
    for name in ("escape", "dangling", "to-pickle"):
        with pytest.raises(LoRANotFound) as info:
            registry.resolve(name)
        assert info.value.name == name
    assert "escape" not in registry.names() and "to-pickle" not in registry.names()


def test_symlinks_inside_the_directory_are_followed(lora_dir, tmp_path):
    (lora_dir / "alias.safetensors").symlink_to(lora_dir / "style-a.safetensors")
    linked = tmp_path / "linked"
    linked.symlink_to(lora_dir, target_is_directory=True)
    assert LoRARegistry(lora_dir).resolve("alias") == (lora_dir / "style-a.safetensors").resolve()
    assert LoRARegistry(linked).resolve("Z") == (lora_dir / "Z.safetensors").resolve()
    assert "alias" in LoRARegistry(linked).names()


def test_new_and_removed_files_are_seen_without_restart(lora_dir):
    registry = LoRARegistry(lora_dir)
    with pytest.raises(LoRANotFound):
        registry.resolve("later")
    (lora_dir / "later.safetensors").write_bytes(b"x")
    (lora_dir / "Z.safetensors").unlink()
    assert registry.resolve("later").name == "later.safetensors"
    assert registry.names() == ["b_2.v1", "later", "style-a"]


def test_missing_directory_is_an_empty_registry(tmp_path):
    registry = LoRARegistry(tmp_path / "absent")
    assert registry.names() == []
    with pytest.raises(LoRANotFound):
        registry.resolve("anything")
    (tmp_path / "afile").write_bytes(b"x")
    assert LoRARegistry(tmp_path / "afile").names() == []


def test_fingerprint_changes_when_a_file_is_replaced(lora_dir):
    path = LoRARegistry(lora_dir).resolve("Z")
    before = LoRARegistry.fingerprint(path)
    assert before == (1, path.stat().st_mtime_ns)
    path.write_bytes(b"y")  # same size: only the mtime tells
    os.utime(path, ns=(before[1] + 10**9, before[1] + 10**9))
    assert LoRARegistry.fingerprint(path) == (1, before[1] + 10**9)
    path.write_bytes(b"longer")
    assert LoRARegistry.fingerprint(path)[0] == 6
