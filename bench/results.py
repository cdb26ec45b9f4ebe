"""bench/results.json: every benchmark merges its figures under its own key."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results.json"


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "platform": platform.platform(),
            "date": time.strftime("%Y-%m-%d")}


def merge_results(key: str, value: dict, path: Path = RESULTS) -> None:
    """Read-modify-write `path`, replacing `key` (atomic rename)."""
    results = json.loads(path.read_text()) if path.exists() else {}
    results[key] = value | {"machine": machine()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)
