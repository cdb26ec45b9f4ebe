"""The steps of bench/gpu_check.sh: engines, learner, end to end. Each prints one JSON line.

    python -m bench.gpu_check engines --device cuda --out DIR
    python -m bench.gpu_check learner --device cuda --out DIR
    python -m bench.gpu_check e2e --device cuda --out DIR [--dry-run]

With `--device cpu` every step runs what needs no GPU (the transformers engine's throughput,
a DeepSpeed step on DeepSpeed's CPU accelerator, the end-to-end config) and reports the vLLM
parts as skipped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROBES = ["12+7=", "abc", "the cat", "99-3=", "hello", "x*y", "2024", "qrs"]
G, NEW_TOKENS = 8, 32
E2E_TIMEOUT_S = 480


def tiny(device: str, out: Path):
    """(tokenizer, model) of a small Llama (head size 64 on CUDA: vLLM's kernels support it)."""
    import torch

    from shardrl.models.tiny import build_tiny_model, train_tokenizer

    tok = train_tokenizer(PROBES + ["0123456789+-*= abcdefghijklmnopqrstuvwxyz"], out / "tok")
    size = dict(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=512) \
        if device == "cuda" else dict(hidden_size=64, num_layers=2, num_heads=2,
                                      intermediate_size=128)
    model = build_tiny_model(tok, max_position_embeddings=128, seed=0, **size)
    return tok, model.to(torch.device(device)).eval()


def timed_generate(engine, prompts: list[list[int]]) -> tuple[list, float]:
    """Samples and tokens/s of G samples of NEW_TOKENS tokens per prompt (after a warm-up)."""
    engine.generate(prompts[:1], 1, temperature=1.0, top_p=1.0, max_new_tokens=4, seed=1)
    start = time.perf_counter()
    groups = engine.generate(prompts, G, temperature=1.0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                             seed=0)
    seconds = time.perf_counter() - start
    return groups, sum(len(s.token_ids) for g in groups for s in g) / seconds


def behaviour_vs_learner(model, prompts: list[list[int]], groups) -> float:
    """Mean |behaviour - learner logprob| over the sampled tokens (learner: FP32 head)."""
    import pyarrow as pa
    import torch

    from shardrl.learner_backends import PolicyModule
    from shardrl.stages.batch import build_batch, padded_column
    from shardrl.stages.update import logprob_mismatch

    rows = [(p, s) for p, g in zip(prompts, groups, strict=True) for s in g if s.token_ids]
    table = pa.table({"prompt_token_ids": [p for p, _ in rows],
                      "response_token_ids": [s.token_ids for _, s in rows],
                      "behavior_logprobs": [s.logprobs for _, s in rows]})
    batch = build_batch(table, pad_id=0)
    with torch.no_grad():
        learner = PolicyModule(model)(batch.input_ids, batch.attention_mask,
                                      batch.response_start).logprobs
    behaviour = batch.pad_response(padded_column(table, "behavior_logprobs"))
    return float(logprob_mismatch(behaviour, learner, batch.response_mask)["logprob_mismatch_abs"])


def engines(device: str, out: Path) -> dict:
    import torch

    from shardrl.engines.hf import HFEngine

    tok, model = tiny(device, out)
    prompts = [tok(p)["input_ids"] for p in PROBES]
    hf = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    groups, hf_tps = timed_generate(hf, prompts)
    result = {"device": device, "hf_tokens_per_s": round(hf_tps, 1),
              "hf_logprob_mismatch_abs": behaviour_vs_learner(model, prompts, groups)}
    if device != "cuda" or importlib.util.find_spec("vllm") is None:
        return result | {"vllm": "skipped: needs CUDA and the vllm extra"}
    from shardrl.engines.vllm import VLLMEngine

    engine = VLLMEngine.from_model(model.cpu(), tok, out / "cache", fp32_lm_head=True,
                                   gpu_memory_utilization=0.3, dtype="float32")
    model.to(device)
    groups, vllm_tps = timed_generate(engine, prompts)
    result |= {"vllm_tokens_per_s": round(vllm_tps, 1),
               "vllm_logprob_mismatch_abs": behaviour_vs_learner(model, prompts, groups)}
    torch.manual_seed(1)  # a new policy version: every weight moved
    new = {k: v.cpu() + 0.05 * torch.randn_like(v.cpu()) for k, v in model.state_dict().items()}
    start = time.perf_counter()
    engine.load_weights(new, version=1)
    model.load_state_dict(new)
    greedy = engine.generate(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0)
    want = HFEngine(model, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id) \
        .generate(prompts, 1, temperature=0.0, top_p=1.0, max_new_tokens=16, seed=0)
    same = sum(g[0].token_ids == w[0].token_ids for g, w in zip(greedy, want, strict=True))
    return result | {"reload_s": round(time.perf_counter() - start, 2),
                     "reload_in_place": engine.rebuilds == 0,
                     "reload_check_agreement": engine.last_agreement,
                     "greedy_same_as_hf_after_reload": f"{same}/{len(prompts)}"}


def learner(device: str, out: Path) -> dict:
    """One DeepSpeed ZeRO-2 step (bf16 on CUDA) next to the torch backend, same batch."""
    import pyarrow as pa
    import torch

    from shardrl.config import load_config
    from shardrl.config.stages import DeepSpeedBackend, LearnerConfig
    from shardrl.learner_backends import build_backend
    from shardrl.stages.update import compute_loss

    cfg = load_config("demo", ["algo.aggregation=token", "algo.kl.placement=none"])
    gen = torch.Generator().manual_seed(0)
    rows, prompt_len, resp_len = 32, 16, 64
    ids = torch.randint(4, 40, (rows, prompt_len + resp_len), generator=gen).tolist()
    table = pa.table({
        "group_id": [i // 4 for i in range(rows)],
        "prompt_token_ids": [r[:prompt_len] for r in ids],
        "response_token_ids": [r[prompt_len:] for r in ids],
        "advantage": torch.randn(rows, generator=gen).tolist(),
        "behavior_logprobs": (-3.0 - torch.rand(rows, resp_len, generator=gen)).tolist(),
        "ref_logprobs": pa.array([None] * rows, pa.list_(pa.float32())),
    })
    result: dict = {"device": device}
    for name, backend_cfg in [("torch", None),
                              ("deepspeed", DeepSpeedBackend(zero_stage=2, bf16=device == "cuda"))]:
        _, model = tiny(device, out)
        lc = LearnerConfig() if backend_cfg is None else LearnerConfig(backend=backend_cfg)
        backend = build_backend(lc, model)
        seconds = []
        for _ in range(3):  # the first step includes the backend's warm-up
            start = time.perf_counter()
            loss, _, _ = compute_loss(cfg, backend.policy, table, 0, beta=0.0)
            applied, norm = backend.step(loss)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
        result[name] = {"loss": float(loss.detach()), "grad_norm": norm, "applied": applied,
                        "tokens_per_s": round(rows * resp_len / min(seconds[1:]), 1)}
    return result


E2E_CONFIG = """\
extends: demo
name: gpu-check
model:
  source: {{kind: tiny, hidden_size: 128, num_layers: 2, num_heads: 2, intermediate_size: 256,
           max_position_embeddings: 64}}
  sft: {{demonstrations: 64, max_epochs: 2, patience: 1, batch_size: 32}}
task:
  source: {{kind: builtin, heldout_size: 16}}
rollout: {{engine: {engine}, gpu_memory_utilization: 0.3, prompts_per_shard: 4, group_size: 4,
          max_new_tokens: 8, poll_interval_s: 0.05}}
learner: {{backend: {backend}, total_steps: 6, batch_prompts: 4, max_staleness: 2,
          warmup_steps: 1, ckpt_every: 2, poll_interval_s: 0.05}}
eval: {{every: 3}}
algo: {{filters: {{zero_variance: false}}, is_correction: {{enabled: true, cap: 2.0}}}}
promote: {{model_name: gpu-check}}
tracking: {{uri: 'sqlite:///{out}/mlflow.db'}}
"""


def metric_means(store: Path, run_id: str, names: list[str]) -> dict[str, float]:
    import pyarrow.parquet as pq

    values: dict[str, list[float]] = {n: [] for n in names}
    for f in sorted((store / "runs" / run_id / "metrics").rglob("*.parquet")):
        t = pq.read_table(f)
        for n, v in zip(t.column("name").to_pylist(), t.column("value").to_pylist(), strict=True):
            if n in values:
                values[n].append(v)
    return {n: round(sum(v) / len(v), 4) for n, v in values.items() if v}


def e2e(device: str, out: Path, dry_run: bool) -> dict:
    """A short pipeline run with vLLM rollouts and the DeepSpeed learner (on CUDA)."""
    from shardrl.config import load_config

    engine = "vllm" if device == "cuda" else "hf"
    backend = "{kind: deepspeed, zero_stage: 2, bf16: true}" if device == "cuda" \
        else "{kind: deepspeed, zero_stage: 2}"
    path = out / "gpu-check.yaml"
    path.write_text(E2E_CONFIG.format(engine=engine, backend=backend, out=out.resolve()))
    cfg = load_config(str(path))
    cmd = [sys.executable, "-m", "shardrl.cli", "run", str(path), "--run-id", "gpu-check",
           "--store", str(out / "store")]
    result = {"device": device, "rollout_engine": cfg.rollout.engine,
              "learner_backend": cfg.learner.backend.kind, "command": " ".join(cmd)}
    if dry_run:
        return result | {"run": "skipped (--dry-run)"}
    env = dict(os.environ, SHARDRL_CACHE=str(out / "cache"))
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=E2E_TIMEOUT_S)
    (out / "e2e.log").write_text(done.stdout + done.stderr)
    names = ["rollout/tokens_per_s", "learn/tokens_per_s", "learn/logprob_mismatch_abs",
             "learn/mismatch_k3", "evaluate/pass_at_1"]
    return result | {"returncode": done.returncode, "seconds": round(time.perf_counter() - start),
                     **metric_means(out / "store", "gpu-check", names)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=["engines", "learner", "e2e"])
    parser.add_argument("--device", choices=["cuda", "cpu"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="e2e: write and check the config")
    args = parser.parse_args(argv)
    out = args.out / args.step
    out.mkdir(parents=True, exist_ok=True)
    if args.step == "engines":
        result = engines(args.device, out)
    elif args.step == "learner":
        result = learner(args.device, out)
    else:
        result = e2e(args.device, out, args.dry_run)
    line = json.dumps({"step": args.step, **result})
    (out / "result.json").write_text(line + "\n")
    print(line, flush=True)
    return 1 if result.get("returncode", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
