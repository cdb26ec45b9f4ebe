"""bench/gpu_check.sh --cpu: the parts of the GPU check that need no GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="the `deepspeed` extra is not installed")
def test_gpu_check_cpu_parts(tmp_path: Path):
    env = dict(os.environ, OUT=str(tmp_path), OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--cpu"], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = {s: json.loads((tmp_path / s / "result.json").read_text())
           for s in ("engines", "learner", "e2e")}

    engines = got["engines"]
    assert engines["hf_tokens_per_s"] > 0
    # the transformers engine's behaviour logprobs are the learner's on the same weights
    assert engines["hf_logprob_mismatch_abs"] < 1e-5
    assert engines["vllm"].startswith("skipped")

    learner = got["learner"]
    torch_step, ds_step = learner["torch"], learner["deepspeed"]
    assert torch_step["applied"] and ds_step["applied"]
    assert ds_step["loss"] == pytest.approx(torch_step["loss"], abs=1e-5)
    assert ds_step["grad_norm"] == pytest.approx(torch_step["grad_norm"], rel=1e-4)
    assert ds_step["tokens_per_s"] > 0

    e2e = got["e2e"]
    assert (e2e["rollout_engine"], e2e["learner_backend"]) == ("hf", "deepspeed")
    assert e2e["run"].startswith("skipped") and "shardrl.cli run" in e2e["command"]
