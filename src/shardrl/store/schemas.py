"""The Arrow schema of each stage boundary.

Later stages add columns and never rewrite earlier ones: SCORED starts with ROLLOUT's
fields, READY with SCORED's. A field is non-nullable unless marked otherwise.

Multi-turn episodes (`rollout.max_turns`, `task.environment`) add the `EPISODE` columns after
a boundary schema's own, in every shard of the run from rollout on: the response is the whole
episode after the prompt (the policy's turns and the environment's replies), and
`policy_mask` says which of its tokens the policy generated. Single-turn shards have none of
them; `store.shards.conform` keeps them at the end of any table that has all of them.
"""

from __future__ import annotations

import pyarrow as pa


def _required(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=False)


def _optional(name: str, type_: pa.DataType) -> pa.Field:
    return pa.field(name, type_, nullable=True)


TOKENS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())

ROLLOUT = pa.schema([
    _required("prompt_id", pa.string()),
    _required("group_id", pa.string()),           # one group = G samples of one prompt
    _required("sample_idx", pa.int32()),           # index within the group
    _required("policy_version", pa.int64()),       # version that generated the sample
    _required("worker", pa.int32()),
    _required("prompt_text", pa.string()),
    _required("prompt_token_ids", TOKENS),
    _required("response_token_ids", TOKENS),
    _required("behavior_logprobs", LOGPROBS),      # one per response token
    _required("finish_reason", pa.string()),       # "stop" | "length"
    _required("response_text", pa.string()),
    _required("answer", pa.string()),              # reference answer of the task
    _required("category", pa.string()),
    _required("created_at", pa.float64()),         # unix time
])

SCORED = pa.schema(list(ROLLOUT) + [
    _optional("reward_verifier", pa.float32()),
    _optional("reward_model", pa.float32()),
    _required("reward_rm", pa.float32()),          # combined raw reward
    _required("correct", pa.bool_()),
    _optional("reward_error", pa.string()),        # why a verifier failed
    _optional("ref_logprobs", LOGPROBS),           # present when KL is on
])

READY = pa.schema(list(SCORED) + [
    _required("reward_total", pa.float32()),
    _required("advantage", pa.float32()),
    _required("keep", pa.bool_()),                 # False: filtered, row kept for accounting
    _optional("filter_reason", pa.string()),
])

EVAL = pa.schema([
    _required("policy_version", pa.int64()),
    _required("prompt_id", pa.string()),
    _required("category", pa.string()),
    _required("sample_idx", pa.int32()),
    _required("prompt_text", pa.string()),
    _required("response_text", pa.string()),
    _required("answer", pa.string()),
    _required("reward", pa.float32()),
    _required("correct", pa.bool_()),
    _required("response_length", pa.int32()),
    _required("finish_reason", pa.string()),
])

METRICS = pa.schema([
    _required("stage", pa.string()),
    _required("name", pa.string()),                # namespaced: "learn/clip_frac"
    _required("step", pa.int64()),
    _required("value", pa.float64()),
    _required("time", pa.float64()),               # unix time
])

EPISODE = pa.schema([
    _required("policy_mask", pa.list_(pa.int8())),  # one per response token: 1 = policy's
    _required("turn_rewards", LOGPROBS),            # the environment's reward of each turn
    _required("turn_starts", pa.list_(pa.int32())),  # response index of each turn's first token
])
"""The columns multi-turn shards carry after their boundary schema's (see the docstring).
`behavior_logprobs` is 0.0 on the environment's tokens, and only the policy's tokens get
loss, logprobs and KL (`stages.batch.build_batch`)."""

SCHEMAS: dict[str, pa.Schema] = {
    "rollout": ROLLOUT, "scored": SCORED, "ready": READY, "eval": EVAL, "metrics": METRICS,
}
"""The boundary schemas by name."""
