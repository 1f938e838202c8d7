"""Config modules are leaves: validating a Serve config loads no model, RPC or Ray code."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "diffusers", "transformers", "grpc", "ray", "cv2", "PIL")


def test_config_modules_import_no_heavy_package():
    probe = (
        "import json, sys\n"
        "import serving.config, disagg.config\n"
        f"print(json.dumps(sorted(name for name in {HEAVY!r} if name in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
