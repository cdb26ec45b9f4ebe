"""Multi-turn episodes for rollout and evaluation: the policy acts, the environment replies.

Every sample of a group plays its own episode in a fresh environment (`task.environment`).
A turn is one generation of up to `rollout.max_new_tokens` tokens, batched over every
episode still running; the turn's text (special tokens removed) goes to the environment's
`step`, whose reply is appended after the turn's tokens in the task's prompt format
(`PromptFormat.observation_text`) before the next turn. An episode ends when the environment
says so, after `max_turns` turns, when a turn is cut at its token budget (the reply would
follow a turn the policy never closed), or when the model's context has no room for the
environment's reply and another token after it. Nothing follows the last turn: the reply
that ends an episode carries no tokens, so a row never outgrows the context.

An episode becomes one rollout row (`EpisodeSample`): its response is every turn's tokens and
replies laid out by `tasks.environments.episode_tokens`, with the policy mask, the per-turn
rewards and where each turn starts (`store.schemas.EPISODE`). Its finish reason is "stop"
when the environment ended it on a turn the policy closed with EOS, else "length". The
episode's reward is the sum of its turns' rewards (the score stage's `task` verifier).

Sampling is deterministic given `seed`: turn 0 samples all `n` episodes of each prompt in
one call, as single-turn rollout does; turn t > 0 samples the running episodes with
`seed + t * TURN_SEED_STRIDE`; in both, episodes with less room left in the context than
`max_new_tokens` are sampled in calls of their own (`_first_turn`, `_later_turn`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..store.schemas import EPISODE
from ..tasks.builtin import TaskItem
from ..tasks.environments import (
    Environment,
    EpisodeTokens,
    Turn,
    episode_tokens,
    make_environment,
)
from .batch import POLICY_MASK

if TYPE_CHECKING:
    from ..engines.base import Sample

TURN_SEED_STRIDE = 1_000_033

Generate = Callable[[list[list[int]], int, int, int], "list[list[Sample]]"]
"""(prompt token ids, samples per prompt, max_new_tokens, seed) -> samples per prompt."""


@dataclass(frozen=True)
class EpisodeSample(EpisodeTokens):
    """An episode's tokens (`EpisodeTokens`) read as an engine's `Sample` (the whole response
    after the prompt, its behaviour logprobs), plus how the episode ended."""

    finish_reason: str = "length"

    @property
    def token_ids(self) -> list[int]:
        return self.response_token_ids

    @property
    def logprobs(self) -> list[float]:
        return self.behavior_logprobs


@dataclass
class _Running:
    env: Environment
    context: list[int]
    turns: list[Turn]
    over: bool = False
    finish: str = "length"


def run_episodes(generate: Generate, make_env: Callable[[], Environment],
                 items: Sequence[TaskItem], prompt_ids: Sequence[list[int]], n: int, *,
                 max_turns: int, max_new_tokens: int, seed: int,
                 decode: Callable[[list[int]], str],
                 encode_observation: Callable[[str], list[int]],
                 context: int | None = None) -> list[list[EpisodeSample]]:
    """`n` episodes per item; result[i] holds item i's, in sample order (module docstring).

    An environment's first observation must be the item's prompt, which `prompt_ids` encode.
    """
    episodes: list[_Running] = []
    for item, ids in zip(items, prompt_ids, strict=True):
        for _ in range(n):
            env = make_env()
            if (first := env.reset(item)) != item.prompt:
                raise ValueError(f"environment's first observation {first!r} is not the "
                                 f"item's prompt {item.prompt!r}")
            episodes.append(_Running(env, list(ids), []))
    for t in range(max_turns):
        running = [e for e in episodes if not e.over]
        for e in running if t > 0 else ():
            if context is not None and context - len(e.context) < 1:
                e.over = True  # no room for another token: finish stays "length"
        running = [e for e in running if not e.over]
        if not running:
            break
        if t == 0:
            samples = _first_turn(generate, prompt_ids, n, max_new_tokens, context, seed)
        else:
            samples = _later_turn(generate, running, max_new_tokens, context,
                                  seed + t * TURN_SEED_STRIDE)
        for e, s in zip(running, samples, strict=True):
            result = e.env.step(decode(s.token_ids))
            # a turn cut at its token budget ends the episode unless it ended it: the reply
            # would follow a turn the policy never closed (no end of turn in the transcript)
            last = result.done or t == max_turns - 1 or s.finish_reason != "stop"
            obs = [] if last else encode_observation(result.observation)
            if obs and context is not None and (
                    len(e.context) + len(s.token_ids) + len(obs) >= context):
                last, obs = True, []  # no room for the reply and a token after it: ends here
            e.turns.append(Turn(list(s.token_ids), list(s.logprobs), obs, float(result.reward)))
            e.context += list(s.token_ids) + obs
            if last:
                e.over = True
                e.finish = "stop" if result.done and s.finish_reason == "stop" else "length"
    out = []
    for e in episodes:
        out.append(EpisodeSample(**vars(episode_tokens(e.turns)), finish_reason=e.finish))
    return [out[i * n:(i + 1) * n] for i in range(len(items))]


def _first_turn(generate: Generate, prompt_ids: Sequence[list[int]], n: int,
                max_new_tokens: int, context: int | None, seed: int) -> list:
    """The first turn's `n` samples per prompt, in order. As in `_later_turn`, prompts with
    room for `max_new_tokens` share one call (`seed`), and each smaller room is a call of its
    own (seed + room): a long prompt never shortens the others' first turns."""
    budgets = [max_new_tokens if context is None else min(max_new_tokens, context - len(ids))
               for ids in prompt_ids]
    if budgets and min(budgets) < 1:
        too_long = budgets.index(min(budgets))
        raise ValueError(f"prompt {too_long} ({len(prompt_ids[too_long])} tokens) fills the "
                         f"model's context of {context} tokens")
    samples: list = [None] * (len(prompt_ids) * n)
    for budget in sorted(set(budgets), reverse=True):
        rows = [i for i, b in enumerate(budgets) if b == budget]
        groups = generate([list(prompt_ids[i]) for i in rows], n, budget,
                          seed + (0 if budget == max_new_tokens else budget))
        for i, group in zip(rows, groups, strict=True):
            samples[i * n:(i + 1) * n] = group
    return samples


def _later_turn(generate: Generate, running: list[_Running], max_new_tokens: int,
                context: int | None, seed: int) -> list:
    """One sample per running episode, in order. Episodes with room in the context for
    `max_new_tokens` share one call; each smaller room is a call of its own (seed + room),
    so an episode near the end of the context never shortens the others' turns."""
    budgets = [max_new_tokens if context is None else min(max_new_tokens,
                                                          context - len(e.context))
               for e in running]
    samples: list = [None] * len(running)
    for budget in sorted(set(budgets), reverse=True):
        rows = [i for i, b in enumerate(budgets) if b == budget]
        groups = generate([running[i].context for i in rows], 1, budget,
                          seed + (0 if budget == max_new_tokens else budget))
        for i, group in zip(rows, groups, strict=True):
            samples[i] = group[0]
    return samples


class EpisodeRunner:
    """`run_episodes` with a stage's policy engine and the run's environment and format."""

    def __init__(self, engine, environment: str, max_turns: int,
                 settings: dict | None = None) -> None:
        self.settings = settings or {}
        """The run's settings an environment may take (see `make_environment`)."""
        make_environment(environment, **self.settings)  # a spec naming nothing fails now
        self.engine, self.environment, self.max_turns = engine, environment, max_turns

    def run(self, items: Sequence[TaskItem], prompt_ids: Sequence[list[int]], n: int, *,
            temperature: float, top_p: float, max_new_tokens: int,
            seed: int) -> list[list[EpisodeSample]]:
        engine = self.engine

        def generate(ids: list[list[int]], k: int, budget: int, s: int) -> list[list[Sample]]:
            return engine.engine.generate(ids, k, temperature=temperature, top_p=top_p,
                                          max_new_tokens=budget, seed=s)

        def observe(text: str) -> list[int]:
            return engine.prompt_format.encode_observation(engine.tokenizer, text)

        def new_environment() -> Environment:
            return make_environment(self.environment, **self.settings)

        return run_episodes(generate, new_environment, items, prompt_ids, n,
                            max_turns=self.max_turns,
                            max_new_tokens=max_new_tokens, seed=seed, decode=engine.decode,
                            encode_observation=observe, context=engine.context)


def episode_runner(ctx, engine) -> EpisodeRunner | None:
    """The stage's runner when the run plays episodes (`task.environment`), else None."""
    cfg = ctx.cfg
    if cfg.task.environment is None:
        return None
    from ..tasks.sandbox import SandboxLimits

    limits = cfg.reward.sandbox  # untrusted tool code runs under the verifiers' limits
    sandbox = SandboxLimits(cpu_seconds=limits.cpu_seconds, memory_mb=limits.memory_mb,
                            wall_seconds=limits.wall_seconds, output_bytes=limits.output_bytes,
                            open_files=limits.open_files)
    return EpisodeRunner(engine, cfg.task.environment, cfg.rollout.max_turns,
                         {"sandbox": sandbox})


def with_episode_columns(table: pa.Table, samples: Sequence[EpisodeSample]) -> pa.Table:
    """A rollout table of episodes (one row per sample, in order) with `EPISODE`'s columns."""
    for f in EPISODE:
        table = table.append_column(f, pa.array([getattr(s, f.name) for s in samples],
                                                type=f.type))
    return table


def policy_tokens(table: pa.Table) -> int:
    """Response tokens the policy generated: all of them, or the masked-in ones of episodes
    (the environment's replies between turns are not trained on)."""
    if POLICY_MASK in table.column_names:
        return int(pc.sum(pc.list_flatten(table.column(POLICY_MASK))).as_py() or 0)
    return int(pc.sum(pc.list_value_length(table.column("response_token_ids"))).as_py() or 0)


def episode_metrics(table: pa.Table) -> dict[str, float]:
    """Rollout metrics of a table of episodes (none for single responses): turns, the
    policy's share of the response tokens, the mean return."""
    if EPISODE.names[0] not in table.column_names:
        return {}
    turns = np.array([len(s) for s in table.column("turn_starts").to_pylist()], np.float64)
    mask = np.concatenate([np.asarray(m, np.float64) for m in
                           table.column("policy_mask").to_pylist()] + [np.ones(0)])
    returns = [sum(r) for r in table.column("turn_rewards").to_pylist()]
    return {"turns_mean": float(turns.mean()), "turns_max": float(turns.max()),
            "policy_token_frac": float(mask.mean()) if mask.size else 1.0,
            "episode_return_mean": float(np.mean(returns))}
