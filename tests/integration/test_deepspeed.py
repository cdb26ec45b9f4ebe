"""DeepSpeed ZeRO learner backend on CPU (DeepSpeed's CPU accelerator, gloo), 1 and 2 ranks.

`ds_worker.py` runs under `torchrun`; each rank computes the learner's loss on the same
batch with the torch backend and with DeepSpeed, resumes from checkpoints of both, and
reports the differences. Importing DeepSpeed alone takes ~20 s here, so the runs are slow.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardrl.config.stages import DeepSpeedBackend
from shardrl.learner_backends.deepspeed_backend import ds_config

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("ds_worker.py")
EXTENSIONS = ROOT / ".shardrl" / "torch_extensions"  # DeepSpeed's JIT-built CPU comm op
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="the `deepspeed` extra is not installed")


def test_ds_config_maps_every_backend_field():
    cfg = DeepSpeedBackend(zero_stage=3, offload_optimizer=True, bf16=True)
    got = ds_config(cfg, grad_clip=None, param_persistence_threshold=0)
    assert got["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "stage3_param_persistence_threshold": 0}
    assert got["bf16"] == {"enabled": True, "check_grad_overflow": True}
    assert got["gradient_clipping"] == 0.0  # no clip
    assert got["gradient_accumulation_steps"] == 1
    plain = ds_config(DeepSpeedBackend(zero_stage=1), grad_clip=0.5)
    assert plain["zero_optimization"] == {"stage": 1}
    assert plain["gradient_clipping"] == 0.5 and plain["bf16"]["enabled"] is False


def run_worker(tmp_path: Path, ranks: int, variants: list[str]) -> list[dict]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(EXTENSIONS), PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={ranks}", str(WORKER), str(tmp_path), *variants]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(ranks)]


@needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "variants"), [(1, ["1", "2", "3", "2+offload", "2+bf16",
                                                      "critic"]),
                                                 (2, ["1", "2", "3", "3+bf16", "critic"])])
def test_deepspeed_matches_torch_and_resumes(tmp_path: Path, ranks: int, variants: list[str]):
    results = run_worker(tmp_path, ranks, variants)
    assert all(r == results[0] for r in results)  # every rank saw the same numbers
    for stage, critic in results[0]["critic"].items():
        # policy and critic trained together; the torch state loaded into a fresh engine
        assert critic["weight_diff"] < 1e-5 and critic["state_diff"] < 1e-5, (stage, critic)
        assert critic["reload_diff"] == 0.0 and critic["critic_keys"] > 0, (stage, critic)
    for variant in (v for v in variants if v.endswith("+bf16")):
        r = results[0][variant]
        # bfloat16 weights are their float32 masters rounded: the masters are in the state,
        # and a resume from it goes on as the run through did, masters and weights
        assert r["master_keys"] > 0 and r["masters_off_weights"] > 0, (variant, r)
        assert r["masters_diff"] < 1e-7 and r["weights_diff"] == 0.0, (variant, r)
    for variant in (v for v in variants if v != "critic" and not v.endswith("+bf16")):
        r = results[0][variant]
        assert r["world_size"] == ranks
        # two steps of the same batch: losses, clipped gradient norms and weights agree with
        # the torch backend up to float32 summation order
        assert r["loss_diff"] < 1e-5 and r["norm_diff"] < 1e-5, (variant, r)
        assert r["weight_diff"] < 1e-5 < r["moved"], (variant, r)
        # resuming after one step (from DeepSpeed's own state or from the torch backend's)
        # gives the weights of the uninterrupted run
        assert r["step_state"] == 1.0
        assert r["leader_holds_all"]  # the checkpoint's copy is on rank 0 alone
        assert r["resume_diff"] < 1e-6 and r["cross_resume_diff"] < 1e-5, (variant, r)
        # a non-finite loss is skipped by every rank and changes nothing
        assert r["skipped"] and r["skip_changed"] == 0.0
        assert r["broadcast"] == {"from_rank": 0, "keys": ["a", "b"]}
        # not DeepSpeed's 10 minutes: followers wait in a collective while the leader waits
        # for rollouts, which can take hours at a run's start
        assert r["collective_timeout_s"] == 30 * 86400  # the longest a stage may run
