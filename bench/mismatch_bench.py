"""Generator/learner logprob mismatch at equal policy version.

The generator samples responses with ShardRL's engine from the weights a rollout worker holds
for version v; the learner recomputes the same tokens' logprobs at its float32 weights of
version v (its forward on the ready shard, `compute_loss`). With float32 publishing both
hold the same weights and the mismatch is the arithmetic's alone (different batch shapes,
the KV cache against a full forward); with bfloat16 publishing the generator's weights are
the learner's rounded to bfloat16, which the issue asks to report. Lag plays no part: both
sides are at the same version, unlike `learn/logprob_mismatch_abs` in a run.

Reports the mean and the 99th percentile of |behaviour - learner| per response token, and
the k3 estimate of KL(behaviour || learner), over `--prompts` held-out prompts of the model's
preset with `group_size` samples each, at the preset's temperature.

    .venv/bin/python -m bench.mismatch_bench --config smollm2 \
        --set model.source.path=models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import pyarrow as pa
import torch

from bench.results import merge_results
from shardrl.config import load_config
from shardrl.engines.hf import HFEngine
from shardrl.learner_backends.base import PolicyModule
from shardrl.models.delta import DTYPES, cast_state, publish_state
from shardrl.stages.batch import build_batch, padded_column
from shardrl.tasks.prompts import PromptFormat
from shardrl.tasks.source import make_task


def measure(cfg, model, tokenizer, publish: torch.dtype, prompts: int, seed: int) -> dict:
    """The mismatch when the generator holds the learner's weights published in `publish`."""
    import copy

    generator = copy.deepcopy(model).eval()
    weights = cast_state(publish_state(model, publish), torch.float32)
    generator.load_state_dict(weights, strict=False)  # what a worker applies, as float32
    fmt = PromptFormat.from_config(cfg)
    rc = cfg.rollout
    engine = HFEngine(generator, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id, fp32_lm_head=cfg.model.fp32_lm_head)
    items = make_task(cfg).heldout[:prompts]
    ids = fmt.encode(tokenizer, [it.prompt for it in items])
    groups = engine.generate(ids, rc.group_size, temperature=rc.temperature, top_p=rc.top_p,
                             max_new_tokens=rc.max_new_tokens, seed=seed)
    samples = [(p, s) for p, g in zip(ids, groups, strict=True) for s in g if s.token_ids]
    table = pa.table({"prompt_token_ids": [p for p, _ in samples],
                      "response_token_ids": [s.token_ids for _, s in samples],
                      "behavior_logprobs": [s.logprobs for _, s in samples]})
    batch = build_batch(table, tokenizer.pad_token_id)
    with torch.no_grad():
        learner = PolicyModule(model)(batch.input_ids, batch.attention_mask,
                                      batch.response_start, temperature=rc.temperature,
                                      fp32_lm_head=cfg.model.fp32_lm_head).logprobs  # (B, T)
    behaviour = batch.pad_response(padded_column(table, "behavior_logprobs"))  # (B, T)
    mask = batch.response_mask.bool()
    diff = (learner - behaviour)[mask]  # (tokens,)
    k3 = diff.exp() - 1.0 - diff
    return {"publish_dtype": str(publish).removeprefix("torch."), "tokens": int(mask.sum()),
            "samples": len(samples), "abs_mean": float(diff.abs().mean()),
            "abs_p99": float(np.percentile(diff.abs().numpy(), 99)),
            "abs_max": float(diff.abs().max()), "k3_mean": float(k3.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="smollm2")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    from shardrl.models.io import load_causal_lm, load_tokenizer

    started = time.monotonic()
    cfg = load_config(args.config, args.overrides)
    path = getattr(cfg.model.source, "path", None)
    if path is None:
        parser.error(f"{args.config}: model.source is not a pretrained model folder")
    torch.manual_seed(cfg.seed)
    model = load_causal_lm(path).to(torch.float32).eval()  # the learner's weights
    tokenizer = load_tokenizer(path)
    rows = [measure(cfg, model, tokenizer, DTYPES[name], args.prompts, args.seed)
            for name in ("float32", "bfloat16")]
    for r in rows:
        print(f"{args.config}, published {r['publish_dtype']}: |behaviour - learner| per token "
              f"mean {r['abs_mean']:.2e}, p99 {r['abs_p99']:.2e}, max {r['abs_max']:.2e}; "
              f"k3 {r['k3_mean']:.2e} ({r['tokens']} tokens)", flush=True)
    merge_results("mismatch", {"config": args.config, "overrides": args.overrides,
                               "prompts": args.prompts, "rows": rows,
                               "bench_seconds": time.monotonic() - started})


if __name__ == "__main__":
    main()
