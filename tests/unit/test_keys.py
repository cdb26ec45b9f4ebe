"""Keys of a run: built, parsed, and ordered as their numbers."""

import re

import pytest

from shardrl.store.keys import (
    RunKeys,
    ShardKey,
    error_key,
    new_run_id,
    parse_shard_key,
    quarantine_key,
)

rk = RunKeys("demo-1")


def test_every_kind_of_key():
    assert rk.root == "runs/demo-1/"
    assert rk.run_json() == "runs/demo-1/run.json"
    assert rk.done() == "runs/demo-1/DONE.json"
    assert rk.ref_file("model.safetensors") == "runs/demo-1/ref/model.safetensors"
    assert rk.policy_prefix(12) == "runs/demo-1/policy/v000012/"
    assert rk.policy_file(12, "config.json") == "runs/demo-1/policy/v000012/config.json"
    assert rk.latest_policy() == "runs/demo-1/policy/LATEST.json"
    assert rk.rollout(12, 0, 34) == "runs/demo-1/rollouts/v000012/w00-000034.parquet"
    assert rk.version_prefix("scored", 12) == "runs/demo-1/scored/v000012/"
    assert rk.kind_prefix("ready") == "runs/demo-1/ready/"
    assert rk.learner_file(100, "optim.safetensors") == (
        "runs/demo-1/learner/ckpt-000100/optim.safetensors"
    )
    assert rk.latest_learner() == "runs/demo-1/learner/LATEST.json"
    assert rk.eval_table(12) == "runs/demo-1/eval/v000012.parquet"
    assert rk.eval_summary(12) == "runs/demo-1/eval/v000012.json"
    assert rk.metrics("learner", "steps") == "runs/demo-1/metrics/learner/steps.parquet"
    assert rk.state("rollout", "prompts/w03.json") == "runs/demo-1/state/rollout/prompts/w03.json"


def test_downstream_shards_are_named_after_their_rollout_shard():
    rollout = rk.rollout(7, 3, 21)
    assert rk.scored_for(rollout) == "runs/demo-1/scored/v000007/w03-000021.parquet"
    assert rk.ready_for(rollout) == "runs/demo-1/ready/v000007/w03-000021.parquet"
    assert rk.ready_for(rk.scored_for(rollout)) == rk.ready_for(rollout)
    with pytest.raises(ValueError, match="belongs to run 'other'"):
        rk.scored_for(RunKeys("other").rollout(7, 3, 21))


def test_parse_shard_key_round_trips():
    key = rk.shard("scored", 12, 5, 34)
    parts = parse_shard_key(key)
    assert parts == ShardKey(run_id="demo-1", kind="scored", version=12, worker=5, seq=34)
    assert parts.key == key


@pytest.mark.parametrize("bad", [
    "runs/demo-1/rollouts/v12/w00-000034.parquet",          # version not 6 digits
    "runs/demo-1/rollouts/v000012/w0-000034.parquet",       # worker not 2 digits
    "runs/demo-1/rollouts/v000012/w00-000034.json",         # not parquet
    "runs/demo-1/policy/v000012/w00-000034.parquet",        # not a shard kind
    "runs/demo-1/rollouts/v000012/w00-000034.parquet/x",    # trailing segment
    "x/runs/demo-1/rollouts/v000012/w00-000034.parquet",    # not at the root
    "",
])
def test_malformed_shard_keys_are_rejected(bad):
    with pytest.raises(ValueError, match="not a shard key"):
        parse_shard_key(bad)


@pytest.mark.parametrize("call", [
    lambda: rk.rollout(-1, 0, 0), lambda: rk.rollout(1_000_000, 0, 0),
    lambda: rk.rollout(1, 100, 0), lambda: rk.rollout(1, 0, 1_000_000),
    lambda: rk.rollout(True, 0, 0), lambda: rk.policy_file(1, "../x"),
    lambda: rk.metrics("learner", "a/b"), lambda: RunKeys("a/b"), lambda: RunKeys(".hidden"),
    lambda: rk.kind_prefix("policy"),
])
def test_out_of_range_or_unsafe_parts_are_rejected(call):
    with pytest.raises(ValueError):
        call()


def test_lexicographic_order_is_numeric_order():
    versions = [0, 9, 10, 99, 100, 123456]
    keys = [rk.rollout(v, w, s) for v in versions for w in (0, 10) for s in (2, 11)]
    assert sorted(keys) == keys


def test_quarantine_keys():
    rollout = rk.rollout(1, 0, 2)
    q = quarantine_key(rollout, "score")
    assert q == "runs/demo-1/quarantine/score/rollouts/v000001/w00-000002.parquet"
    assert q == rk.quarantine("score", rollout)
    assert error_key(q) == q + ".error.json"
    assert quarantine_key("loose/file.parquet", "learn") == "quarantine/learn/loose/file.parquet"


def test_run_ids_made_in_the_same_second_differ():
    """Two replays of one run started in the same second used to get the same default id."""
    ids = {new_run_id("demo-replay") for _ in range(20)}
    assert len(ids) > 1
    for made in ids:
        assert re.fullmatch(r"demo-replay-\d{8}-\d{6}-[0-9a-f]{4}", made)
        assert RunKeys(made).root == f"runs/{made}/"  # a valid run name
