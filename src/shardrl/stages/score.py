"""score: rewards from verifiers and/or a reward model; reference logprobs when KL is on."""

from __future__ import annotations

import time

import numpy as np
import pyarrow as pa
import torch

from ..store.schemas import ROLLOUT, SCORED
from ..store.shards import write_shard
from ..tasks.source import make_task
from .batch import build_batch, unpad
from .context import StageContext
from .scan import Scanner, output_names, process_shards


def main(ctx: StageContext) -> int:
    cfg, keys, store = ctx.cfg, ctx.keys, ctx.store
    ctx.wait_for_run()
    scorer = Scorer(ctx)
    scanner = Scanner(store, keys, cfg, "score", output_names(store, keys, "scored"))

    def handle(key: str, table: pa.Table) -> None:
        write_shard(store, keys.scored_for(key), scorer.score(table), SCORED)

    return process_shards(ctx, scanner, ROLLOUT, handle, cfg.score.poll_interval_s)


class Scorer:
    """Holds the verifiers, the reward model and the reference for the life of the stage."""

    def __init__(self, ctx: StageContext) -> None:
        from ..tasks.rewards import build_reward

        self.ctx = ctx
        cfg = ctx.cfg
        self.reward = build_reward(cfg, make_task(cfg))
        self.ref = None
        if cfg.algo.kl.placement != "none" and not cfg.learner_reference:
            from .policy import load_reference

            self.ref, tokenizer = load_reference(ctx.store, ctx.keys, ctx.cache_dir())
            self.ref.eval()
            self.pad_id = tokenizer.pad_token_id

    def score(self, table: pa.Table) -> pa.Table:
        started = time.monotonic()
        result = self.reward.score_table(table)
        out = table
        for name in ("reward_verifier", "reward_model", "reward_rm", "correct", "reward_error"):
            out = out.append_column(name, pa.array(result[name], type=SCORED.field(name).type))
        ref = [None] * len(table)
        if self.ref is not None:
            with self.ctx.cores.busy():
                ref = self._ref_logprobs(table)
        out = out.append_column("ref_logprobs", pa.array(ref, type=SCORED.field("ref_logprobs").type))
        rewards = np.asarray(result["reward_rm"], dtype=np.float64)
        version = int(table.column("policy_version")[0].as_py())
        self.ctx.metrics.log(version, {
            "reward_rm_mean": float(rewards.mean()), "reward_rm_std": float(rewards.std()),
            "verifier_errors": float(sum(e is not None for e in result["reward_error"])),
            "pass_rate": float(np.mean(result["correct"])),
            "seconds_per_shard": time.monotonic() - started,
        })
        return out

    @torch.no_grad()
    def _ref_logprobs(self, table: pa.Table) -> list[list[float]]:
        from ..models.heads import token_logprobs

        batch = build_batch(table, self.pad_id)
        out = token_logprobs(self.ref, batch.input_ids, batch.attention_mask, batch.response_start,
                             temperature=self.ctx.cfg.rollout.temperature,
                             fp32_lm_head=self.ctx.cfg.model.fp32_lm_head)
        return unpad(out.logprobs, batch.response_lengths)
