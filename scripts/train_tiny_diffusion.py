"""Train the ``tiny`` diffusion preset (VAE, text encoder, UNet, canny ControlNet, two style LoRAs) on the shapes
world and write ``serving/weights/tiny/``.

``.venv/bin/python scripts/train_tiny_diffusion.py`` (seeded, CPU); ``--stages`` runs some stages only (each
reads the previous stage's weights from ``--work``); ``--help`` for the rest (``serving.shapes.training.main``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serving.shapes.training import main

if __name__ == "__main__":
    raise SystemExit(main())
