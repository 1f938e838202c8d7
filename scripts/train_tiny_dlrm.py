"""Train the ``tiny`` DLRM on synthetic click logs and write ``disagg/weights/tiny/model.safetensors`` (+ ``.json``).

``.venv/bin/python scripts/train_tiny_dlrm.py`` (seeded, CPU, about a minute); options: ``--help``
(``disagg.training.main``). The generator's ground truth lives in ``disagg/click_logs.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from disagg.training import main

if __name__ == "__main__":
    raise SystemExit(main())
