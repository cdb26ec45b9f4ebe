"""DeepSpeed learner backend on a GPU (nccl): the CPU test's checks, one rank, fp32."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "integration" / "ds_worker.py"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                       reason="needs the `deepspeed` extra"),
]


def test_deepspeed_on_gpu_matches_torch_and_resumes(tmp_path: Path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    env.pop("DS_ACCELERATOR", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(WORKER), str(tmp_path), "2", "3"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "result-0.json").read_text())
    for variant, r in results.items():
        # the torch backend ran on the CPU: GPU kernels sum in another order
        assert r["loss_diff"] < 1e-4 and r["weight_diff"] < 1e-4 < r["moved"], (variant, r)
        assert r["resume_diff"] < 1e-5 and r["cross_resume_diff"] < 1e-4, (variant, r)
        assert r["skipped"] and r["skip_changed"] == 0.0
