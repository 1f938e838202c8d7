"""LoRA names -> ``.safetensors`` files in one directory; a name can never reach outside it."""

from __future__ import annotations

import os
import re
from pathlib import Path

from serving.common.errors import RequestItemError
from serving.common.logging import get_logger

logger = get_logger("lora.registry")

SUFFIX = ".safetensors"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


class InvalidLoRAName(RequestItemError):
    """A LoRA name that is not a plain file stem (path separators, ``..``, NUL, too long, ...): 400."""

    def __init__(self, name: str) -> None:
        super().__init__(400, f"invalid LoRA name: {name!r}: names are 1-128 of [A-Za-z0-9_.-], starting "
                         "alphanumeric, without '..'", field="loras", name=name, code="invalid_lora_name")


class LoRANotFound(RequestItemError):
    """No servable ``<name>.safetensors`` in the LoRA directory: 404."""

    def __init__(self, name: str) -> None:
        super().__init__(404, f"LoRA {name!r} does not exist", field="loras", name=name, code="lora_not_found")


def is_valid_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None and ".." not in name


class LoRARegistry:
    """The LoRA files in ``directory``. Scanned on every call, so added or replaced files need no restart."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def resolve(self, name: str) -> Path:
        """The real path of ``<name>.safetensors`` (symlinks followed, staying inside the directory)."""
        if not is_valid_name(name):
            raise InvalidLoRAName(name if isinstance(name, str) else repr(name))
        root = self.directory.resolve()
        try:
            path = (root / f"{name}{SUFFIX}").resolve(strict=True)
        except (OSError, RuntimeError):  # missing, dangling or looping symlink, unreadable directory
            raise LoRANotFound(name) from None
        if not path.is_relative_to(root) or path.suffix != SUFFIX:
            logger.warning("LoRA %r resolves to %s, outside %s or not %s; refused", name, path, root, SUFFIX)
            raise LoRANotFound(name)
        if not path.is_file():
            raise LoRANotFound(name)
        return path

    def names(self) -> list[str]:
        """Sorted names of the servable LoRA files; an absent directory is an empty registry."""
        return list(self.paths())

    def paths(self) -> dict[str, Path]:
        """Each servable LoRA's real path (``resolve``), by name in sorted order."""
        try:
            entries = os.listdir(self.directory)
        except OSError:
            return {}
        found = {}
        for entry in entries:
            name = entry.removesuffix(SUFFIX)
            if entry.endswith(SUFFIX) and is_valid_name(name):
                try:
                    found[name] = self.resolve(name)
                except LoRANotFound:
                    continue
        return dict(sorted(found.items()))

    @staticmethod
    def fingerprint(path: Path) -> tuple[int, int]:
        """(size, mtime_ns): changes when a file is replaced, so caches reload it."""
        info = Path(path).stat()
        return info.st_size, info.st_mtime_ns
