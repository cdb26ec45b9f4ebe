"""The configured reward: verifiers (optionally sandboxed) + reward model - overlong penalty."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..config import RunConfig
from ..tasks.sandbox import SandboxLimits
from ..tasks.source import TaskData
from ..tasks.verifiers import get_verifier, run_verifier


class Reward:
    def __init__(self, cfg: RunConfig, task: TaskData) -> None:
        rc = cfg.reward
        limits = SandboxLimits(cpu_seconds=rc.sandbox.cpu_seconds, memory_mb=rc.sandbox.memory_mb,
                               wall_seconds=rc.sandbox.wall_seconds)
        self.verifiers = [
            (task.verify if v.name == "task" and not v.sandboxed
             else get_verifier(v.name, sandboxed=v.sandboxed, limits=limits), v.weight)
            for v in rc.verifiers
        ]
        self.rm = self.rm_tokenizer = None
        if rc.reward_model is not None:
            from ..models.heads import load_reward_model
            from ..models.io import load_tokenizer

            self.rm = load_reward_model(rc.reward_model.path)
            self.rm_tokenizer = load_tokenizer(rc.reward_model.path)
        self.cfg = cfg

    def score_table(self, table: pa.Table) -> dict[str, list]:
        rc = self.cfg.reward
        responses = table.column("response_text").to_pylist()
        answers = table.column("answer").to_pylist()
        n = len(responses)
        verifier = np.zeros(n)
        correct = np.zeros(n, dtype=bool)
        errors: list[str | None] = [None] * n
        for i, (resp, ans) in enumerate(zip(responses, answers, strict=True)):
            for j, (fn, weight) in enumerate(self.verifiers):
                value, err = run_verifier(fn, resp, ans)
                verifier[i] += weight * value
                if j == 0:
                    correct[i] = value >= 1.0
                if err is not None:
                    errors[i] = err
        rm = None
        if self.rm is not None:
            from ..models.heads import score_texts

            texts = [p + r for p, r in zip(table.column("prompt_text").to_pylist(), responses,
                                           strict=True)]
            rm = np.asarray(score_texts(self.rm, self.rm_tokenizer, texts,
                                        rc.reward_model.batch_size), dtype=np.float64)
        total = (verifier if self.verifiers else np.zeros(n)) + (
            rc.reward_model.weight * rm if rm is not None else 0.0)
        if rc.overlong is not None:
            total = total - self._overlong(table)
        total = np.where(np.isfinite(total), total, 0.0)
        return {
            "reward_verifier": verifier.tolist() if self.verifiers else [None] * n,
            "reward_model": rm.tolist() if rm is not None else [None] * n,
            "reward_rm": total.tolist(), "correct": correct.tolist(), "reward_error": errors,
        }

    def _overlong(self, table: pa.Table) -> np.ndarray:
        """Linear penalty over the last `buffer_tokens` before max_new_tokens (DAPO)."""
        over = self.cfg.reward.overlong
        limit = self.cfg.rollout.max_new_tokens
        lengths = np.array([len(r) for r in table.column("response_token_ids").to_pylist()])
        start = limit - over.buffer_tokens
        frac = np.clip((lengths - start) / max(over.buffer_tokens, 1), 0.0, 1.0)
        return over.penalty * frac


def build_reward(cfg: RunConfig, task: TaskData) -> Reward:
    return Reward(cfg, task)


