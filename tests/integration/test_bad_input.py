"""Bad input: each kind gives a clear error or is quarantined with its reason; nothing else is lost.

The stages are driven in-process (`--once` rounds) on small synthetic shards cut from one real
rollout shard of the tiny model, so no whole run is needed.
"""

from __future__ import annotations

import importlib
import io
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from e2e.conftest import TINY, run_cli
from shardrl.config import RunConfig, load_config
from shardrl.models.heads import RewardModelError
from shardrl.models.io import TokenizerMismatch, save_model
from shardrl.models.tiny import build_tiny_model, train_tokenizer
from shardrl.orchestrate.accounting import account
from shardrl.stages.context import MetricsSink, StageContext
from shardrl.stages.engine import PolicyEngine
from shardrl.stages.rollout import MAX_EMPTY_SHARDS, _fitting
from shardrl.store import LocalStore, RunKeys, read_shard, shards_by_name, write_shard
from shardrl.store.records import WorkerState
from shardrl.store.schemas import READY, ROLLOUT, SCORED
from shardrl.tasks.builtin import TaskItem
from shardrl.tasks.datasets import DatasetError
from shardrl.tasks.source import make_task

CONFIG = TINY + "tracking: {enabled: false}\n"


def config(tmp: Path, *overrides: str):
    path = tmp / "tiny.yaml"
    path.write_text(CONFIG)
    return load_config(str(path), list(overrides))


def replace(cfg: RunConfig, changes: dict[str, object]) -> RunConfig:
    """`cfg` with dotted fields changed, validated again."""
    data = cfg.model_dump(mode="json")
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = data
        for name in parents:
            node = node[name]
        node[last] = value
    return RunConfig.model_validate(data)


def context(store, cfg, run_id: str, stage: str) -> StageContext:
    ctx = StageContext(stage=stage, cfg=cfg, run_id=run_id, store=store, once=True,
                       log=logging.getLogger(f"test.{stage}"))
    ctx.metrics = MetricsSink(store, ctx.keys, stage, 0)
    return ctx


def run_stage(store, cfg, run_id: str, stage: str) -> int:
    """One `--once` round of a stage, in this process."""
    ctx = context(store, cfg, run_id, stage)
    if stage == "learn":
        from shardrl.stages.learn import Learner

        code = Learner(ctx).run()
    else:
        code = importlib.import_module(f"shardrl.stages.{stage}").main(ctx)
    ctx.metrics.flush()
    return code


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A store whose run 'base' has a snapshot (no SFT) and one real rollout shard."""
    root = tmp_path_factory.mktemp("bad-input")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDRL_CACHE", str(root / "cache"))
        torch.set_num_threads(1)
        # the template's rollout shard is written alongside its ready shard
        cfg = config(root, "model.sft.enabled=false", "rollout.inline_shards=all")
        store = LocalStore(root / "store")
        for stage in ("snapshot", "rollout"):
            torch.manual_seed(0)
            assert run_stage(store, cfg, "base", stage) == 0
        yield store, cfg, root


@pytest.fixture
def run(base, request, monkeypatch):
    """(store, cfg, run_id, template rollout table): a fresh run sharing the base snapshot."""
    store, cfg, root = base
    monkeypatch.setenv("SHARDRL_CACHE", str(root / "cache"))
    run_id = re.sub(r"[^A-Za-z0-9-]", "-", request.node.name)[:60]
    src, dst = RunKeys("base"), RunKeys(run_id)
    for key in store.list(src.root):
        if key.startswith((src.ref_prefix(), src.root + "policy/")) or key == src.run_json():
            store.put_bytes(dst.root + key[len(src.root):], store.get_bytes(key))
    template = read_shard(store, src.rollout(0, 0, 0), ROLLOUT)
    assert len(template) == 8  # 2 prompts x group of 4 (TINY)
    return store, cfg, run_id, template


def with_column(table: pa.Table, name: str, values: list) -> pa.Table:
    i = table.column_names.index(name)
    return table.set_column(i, table.schema.field(name), pa.array(values, table.schema.field(name).type))


def error_of(store, quarantined_key: str) -> dict:
    return store.get_json(quarantined_key + ".error.json")


def test_corrupt_and_wrong_schema_shards_are_quarantined_with_their_reason(run):
    store, cfg, run_id, template = run
    keys = RunKeys(run_id)
    write_shard(store, keys.rollout(0, 0, 0), template, ROLLOUT)              # good
    good = store.get_bytes(keys.rollout(0, 0, 0))
    store.put_bytes(keys.rollout(0, 0, 1), good[: len(good) // 2])           # truncated Parquet
    sink = io.BytesIO()
    pq.write_table(template.drop_columns(["behavior_logprobs"]), sink)
    store.put_bytes(keys.rollout(0, 0, 2), sink.getvalue())                   # a column missing
    sink = io.BytesIO()
    wrong = with_column(template, "prompt_id", ["p"] * 8).set_column(
        template.column_names.index("response_token_ids"), "response_token_ids",
        pa.array([["a"]] * 8))
    pq.write_table(wrong, sink)
    store.put_bytes(keys.rollout(0, 0, 3), sink.getvalue())                   # a mistyped column
    write_shard(store, keys.rollout(0, 0, 4), template, ROLLOUT)              # good, bad later

    assert run_stage(store, cfg, run_id, "score") == 0
    assert run_stage(store, cfg, run_id, "prepare") == 0
    # the ready shard of seq 4 rots before the learner reads it
    store.put_bytes(keys.shard("ready", 0, 0, 4), b"PAR1 not really")
    assert run_stage(store, cfg, run_id, "learn") == 0

    q = keys.root + "quarantine/"
    assert error_of(store, q + "score/rollouts/v000000/w00-000001.parquet")["error_type"] == \
        "CorruptShard"
    missing = error_of(store, q + "score/rollouts/v000000/w00-000002.parquet")
    assert missing["error_type"] == "SchemaError" and "missing ['behavior_logprobs']" in \
        missing["message"]
    mistyped = error_of(store, q + "score/rollouts/v000000/w00-000003.parquet")
    assert "response_token_ids" in mistyped["message"] and mistyped["stage"] == "score"
    assert error_of(store, q + "learn/ready/v000000/w00-000004.parquet")["stage"] == "learn"
    # the good shard went all the way: one learner step on its 2 groups
    assert store.get_json(keys.state("learn", "progress.json"))["version"] == 1
    # upstream stages do not regenerate what a later stage quarantined
    assert run_stage(store, cfg, run_id, "prepare") == 0
    assert run_stage(store, cfg, run_id, "score") == 0
    assert not store.exists(keys.shard("ready", 0, 0, 4))
    acc = account(store, keys)
    # generated: seq 0 (8) + the readable quarantined rollouts seq 2, 3 (8 + 8) + seq 4 (8);
    # the truncated seq 1 cannot be counted and is reported apart
    assert (acc.generated, acc.consumed, acc.quarantined, acc.unconsumed) == (32, 8, 24, 0)
    assert acc.unreadable_quarantined_shards == 1 and acc.balanced


def test_a_null_inside_a_token_list_is_quarantined_not_a_crash_loop(run):
    """Parquet lists may hold null items, which no tensor can: a shard with one is refused
    on reading (a SchemaError, quarantined) instead of failing the stage at every restart."""
    store, cfg, run_id, template = run
    keys = RunKeys(run_id)
    logprobs = template.column("behavior_logprobs").to_pylist()
    logprobs[3] = [None] + logprobs[3][1:]
    sink = io.BytesIO()
    pq.write_table(with_column(template, "behavior_logprobs", logprobs), sink)
    store.put_bytes(keys.rollout(0, 0, 0), sink.getvalue())
    write_shard(store, keys.rollout(0, 0, 1), template, ROLLOUT)
    write_shard(store, keys.rollout(0, 0, 2), template, ROLLOUT)  # good all the way
    assert run_stage(store, cfg, run_id, "score") == 0
    assert run_stage(store, cfg, run_id, "prepare") == 0
    # a ready shard whose token ids hold a null, read by the learner
    ready = read_shard(store, keys.shard("ready", 0, 0, 1), READY)
    tokens = ready.column("response_token_ids").to_pylist()
    tokens[0] = tokens[0][:1] + [None] + tokens[0][1:]
    sink = io.BytesIO()
    pq.write_table(with_column(ready, "response_token_ids", tokens), sink)
    store.put_bytes(keys.shard("ready", 0, 0, 1), sink.getvalue())
    assert run_stage(store, cfg, run_id, "learn") == 0
    q = keys.root + "quarantine/"
    for stage, kind in (("score", "rollouts"), ("learn", "ready")):
        seq = 0 if stage == "score" else 1
        error = error_of(store, q + f"{stage}/{kind}/v000000/w00-{seq:06d}.parquet")
        assert error["error_type"] == "SchemaError" and "null item" in error["message"], error
    assert store.get_json(keys.state("learn", "progress.json"))["version"] == 1  # on seq 2


def test_non_finite_logprobs_and_empty_responses_cost_only_their_rows(run):
    store, cfg, run_id, template = run
    keys = RunKeys(run_id)
    logprobs = template.column("behavior_logprobs").to_pylist()
    tokens = template.column("response_token_ids").to_pylist()
    texts = template.column("response_text").to_pylist()
    logprobs[0] = [float("nan")] * len(logprobs[0])
    logprobs[5][0] = float("-inf")
    for i in (2, 3):  # empty responses
        tokens[i], logprobs[i], texts[i] = [], [], ""
    table = with_column(with_column(with_column(template, "behavior_logprobs", logprobs),
                                    "response_token_ids", tokens), "response_text", texts)
    write_shard(store, keys.rollout(0, 0, 0), table, ROLLOUT)
    for stage in ("score", "prepare", "learn"):
        assert run_stage(store, cfg, run_id, stage) == 0
    ready = read_shard(store, keys.shard("ready", 0, 0, 0), READY)
    assert ready.column("filter_reason").to_pylist() == [
        "non_finite_logprobs", None, None, None, None, "non_finite_logprobs", None, None]
    assert ready.column("keep").to_pylist() == [False, True, True, True, True, False, True, True]
    progress = store.get_json(keys.state("learn", "progress.json"))
    # the step was applied on the 6 good rows (a NaN would have made it skip the whole batch)
    assert progress["version"] == 1 and progress["counts"] == {"consumed": 6, "filtered": 2}
    assert account(store, keys).balanced


def test_non_finite_rewards_are_filtered_and_keep_statistics_finite(run):
    store, cfg, run_id, template = run
    cfg = replace(cfg, {"algo.shaping.normalize": True})
    keys = RunKeys(run_id)
    write_shard(store, keys.rollout(0, 0, 0), template, ROLLOUT)
    assert run_stage(store, cfg, run_id, "score") == 0
    scored = read_shard(store, keys.shard("scored", 0, 0, 0), SCORED)
    rewards = scored.column("reward_rm").to_pylist()
    rewards[1], rewards[6] = float("nan"), float("inf")  # e.g. a reward model that blew up
    write_shard(store, keys.shard("scored", 0, 0, 0), with_column(scored, "reward_rm", rewards),
                SCORED)
    assert run_stage(store, cfg, run_id, "prepare") == 0
    ready = read_shard(store, keys.shard("ready", 0, 0, 0), READY)
    reasons = ready.column("filter_reason").to_pylist()
    assert [i for i, r in enumerate(reasons) if r] == [1, 6]
    assert {reasons[1], reasons[6]} == {"non_finite_reward"}
    assert all(map(torch.isfinite, torch.tensor(ready.column("advantage").to_pylist())))
    # the running reward statistics saw the 6 finite rewards only, and were saved
    moments = store.get_json(keys.state("prepare", "state.json"))["moments"]
    assert moments["count"] == 6.0


def test_rewards_clipped_before_normalizing_are_normalized_by_their_own_statistics(run):
    """With `clip_before_norm` the running statistics take the clipped scores: two groups of
    [0, 0, 100, 100] clipped to 5 are [0, 0, 5, 5] twice, mean 2.5 and std sqrt(50 / 7) =
    2.6726, so the totals are -+2.5 / 2.6726 = -+0.9354. With the statistics of the unclipped
    scores (mean 50, std 53.45) every total came out negative: -0.935 and -0.842."""
    store, cfg, run_id, template = run
    cfg = replace(cfg, {"algo.shaping.normalize": True, "algo.shaping.clip": 5.0,
                        "algo.shaping.clip_before_norm": True})
    keys = RunKeys(run_id)
    write_shard(store, keys.rollout(0, 0, 0), template, ROLLOUT)
    assert run_stage(store, cfg, run_id, "score") == 0
    scored = read_shard(store, keys.shard("scored", 0, 0, 0), SCORED)
    assert len(set(scored.column("group_id").to_pylist()[:4])) == 1  # two groups of 4
    write_shard(store, keys.shard("scored", 0, 0, 0),
                with_column(scored, "reward_rm", [0.0, 0.0, 100.0, 100.0] * 2), SCORED)
    assert run_stage(store, cfg, run_id, "prepare") == 0
    ready = read_shard(store, keys.shard("ready", 0, 0, 0), READY)
    total = ready.column("reward_total").to_pylist()
    assert total == pytest.approx([-0.9354, -0.9354, 0.9354, 0.9354] * 2, abs=1e-4)
    moments = store.get_json(keys.state("prepare", "state.json"))["moments"]
    assert (moments["count"], moments["mean"]) == (8.0, 2.5)


def test_prompts_longer_than_the_context_are_recorded_and_skipped(run):
    store, cfg, run_id, _ = run
    ctx = context(store, cfg, run_id, "rollout")
    engine = PolicyEngine(ctx, 0)
    window = cfg.model.source.max_position_embeddings
    assert engine.context == window
    items = make_task(cfg).train_items(0, 0, 2)
    assert all(len(it.prompt) + 1 + cfg.rollout.max_new_tokens <= window for it in items)
    long = TaskItem("long", "ab" * 40 + "=", "41", "default")
    fitting, ids = _fitting(ctx, engine, [items[0], long, items[1]], seq=7)
    assert fitting == items and ids == engine.encode([it.prompt for it in items])
    record = store.get_json(ctx.keys.quarantine("rollout", ctx.keys.root + "prompts/w00-000007.json"))
    # one token per character (unknown ones too) plus <s>: 81 + 1 = 82 prompt tokens, which
    # with max_new_tokens exceed the context
    assert 82 + cfg.rollout.max_new_tokens > window
    assert record["reason"] == "prompt_too_long" and record["context"] == window
    assert record["prompts"] == [{"prompt_id": "long", "prompt_tokens": 82}]
    # a prompt that encodes to no token (a tokenizer that adds no <s>) is skipped too: it
    # would be sampled from padding alone, and the learner would refuse its rows
    empty = TaskItem("empty", "", "0", "default")
    encode = engine.encode
    engine.encode = lambda prompts: [[] if p == "" else ids
                                     for p, ids in zip(prompts, encode(prompts), strict=True)]
    fitting, ids = _fitting(ctx, engine, [items[0], empty, long], seq=8)
    assert fitting == [items[0]] and ids == encode([items[0].prompt])
    record = store.get_json(ctx.keys.quarantine("rollout", ctx.keys.root + "prompts/w00-000008.json"))
    assert record["reason"] == "empty_prompt_or_too_long"
    assert record["prompts"] == [{"prompt_id": "empty", "prompt_tokens": 0},
                                 {"prompt_id": "long", "prompt_tokens": 82}]


def test_a_task_whose_every_prompt_is_too_long_fails_clearly(run):
    store, cfg, run_id, _ = run
    cfg = replace(cfg, {"rollout.max_new_tokens": 31})  # 1 token left of the 32 for a prompt
    from shardrl.config import ConfigError

    with pytest.raises(ConfigError, match="longer than the context"):  # not restarted
        run_stage(store, cfg, run_id, "rollout")
    keys = RunKeys(run_id)
    assert shards_by_name(store, keys, ("rollouts", "ready")) == {}
    assert len(store.list(keys.root + "quarantine/rollout/prompts/")) == MAX_EMPTY_SHARDS


def test_held_out_prompts_that_leave_no_room_stop_the_evaluation_before_it_samples(run):
    """An evaluation cannot skip held-out prompts as rollout does (its pass@1 would be over
    other items than its setup names): it stops with the config error, naming them."""
    from shardrl.config import ConfigError
    from shardrl.stages.evaluate import evaluate_version

    store, cfg, run_id, _ = run
    window = cfg.model.source.max_position_embeddings
    cfg = replace(cfg, {"eval.max_new_tokens": window - 2})  # room for a 2-token prompt
    ctx = context(store, cfg, run_id, "evaluate")
    engine = PolicyEngine(ctx, 0)
    task = make_task(cfg)
    sizes = [len(ids) for ids in engine.encode([it.prompt for it in task.heldout])]
    assert min(sizes) > 2 and len(sizes) == 16  # none of the 16 fits
    sampled = []
    engine.engine.generate = lambda *a, **k: sampled.append(a) or []
    with pytest.raises(ConfigError) as err:
        evaluate_version(ctx, engine, task, 0)
    (problem,) = err.value.errors
    first = task.heldout[0]
    assert problem.path == "eval.max_new_tokens"
    assert (f"16 of 16 held-out prompt(s) are empty or leave no room for {window - 2} new "
            f"token(s) in the model's context of {window} tokens: {first.prompt_id} "
            f"({sizes[0]} tokens)") in problem.message
    assert problem.message.count(" tokens), ") == 4 and "and 11 more" in problem.message
    assert sampled == [] and store.list(RunKeys(run_id).root + "eval/") == []
    # with room for every prompt, the same evaluation runs
    del engine.engine.generate
    cfg = replace(cfg, {"eval.max_new_tokens": window - max(sizes)})
    ctx = context(store, cfg, run_id, "evaluate")
    assert evaluate_version(ctx, engine, task, 0)["prompts"] == 16


def test_a_run_whose_prompts_never_fit_stops_at_once_saying_why(tmp_path):
    """A rollout worker that finds the config invalid exits 2 and writes the run's abort
    marker with the reason: the runner stops the run at once, with no restart."""
    from shardrl.store.records import Aborted

    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    res = run_cli(["run", str(path), "--store", str(tmp_path / "store"), "--run-id", "long",
                   "--no-progress", "--set", "model.sft.enabled=false",
                   "--set", "rollout.max_new_tokens=31", "--set", "eval.max_new_tokens=5"],
                  tmp_path, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "run aborted: rollout" in out and "invalid config: rollout.max_new_tokens" in out
    assert "restarting in" not in out, out[-3000:]
    marker = Aborted.read(LocalStore(tmp_path / "store"), RunKeys("long").aborted())
    assert (marker.stage, marker.exit_code, marker.restarts) == ("rollout", 2, 0)


def test_a_run_whose_held_out_prompts_do_not_fit_stops_in_the_snapshot(tmp_path):
    """The evaluation's budget defaults to the rollout's: the snapshot's evaluation of v0
    finds the held-out prompts too long and the run stops there, before any RL stage."""
    path = tmp_path / "tiny.yaml"
    path.write_text(CONFIG)
    res = run_cli(["run", str(path), "--store", str(tmp_path / "store"), "--run-id", "long",
                   "--no-progress", "--set", "model.sft.enabled=false",
                   "--set", "rollout.max_new_tokens=31"], tmp_path, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-3000:]
    assert "snapshot failed (exit 2)" in out, out[-3000:]
    assert ("invalid config: rollout.max_new_tokens: 16 of 16 held-out prompt(s) are empty or "
            "leave no room for 31 new token(s) in the model's context of 32 tokens") in out
    # the RL phase never started: no progress line (its first comes once v0 is evaluated)
    assert "restarting in" not in out and "step 0/" not in out
    keys = RunKeys("long")
    store = LocalStore(tmp_path / "store")
    assert not store.exists(keys.run_json()) and store.list(keys.root + "rollouts/") == []


def test_a_stage_on_a_run_with_no_snapshot_says_what_it_waits_for(tmp_path):
    """`shardrl stage learn --run-id <a typo>` waited for policy v0 in silence."""
    import os
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-m", "shardrl.cli", "stage", "learn", "--config", "demo", "--run-id",
         "ghost", "--store", str(tmp_path / "store")], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=dict(os.environ, SHARDRL_CACHE=str(tmp_path / "cache")))
    import threading

    timer = threading.Timer(60, proc.kill)  # a stage that says nothing is killed, and fails
    timer.start()
    try:
        line = proc.stdout.readline()  # the stage's first log line, before any wait
    finally:
        timer.cancel()
        proc.kill()
        proc.wait(timeout=30)
    assert line.rstrip().endswith("learn INFO waiting for the run's snapshot to publish policy "
                                  f"v0 (runs/ghost/policy/v000000/ in {LocalStore(tmp_path / 'store').uri})"
                                  ), line


def test_dataset_row_without_answer_is_a_clear_error(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    heldout = tmp_path / "eval.jsonl"
    heldout.write_text('{"prompt": "3+3=", "answer": "6"}\n')
    cfg = config(tmp_path, "task.source.kind=dataset", f"task.source.train_path={train}",
                 f"task.source.eval_path={heldout}")
    with pytest.raises(DatasetError, match=r"train.jsonl: row 2: missing column 'answer'"):
        make_task(cfg)


def test_tokenizer_mismatch_between_policy_and_reference_stops_the_snapshot(run, tmp_path):
    store, cfg, run_id, _ = run
    other = tmp_path / "other-ref"
    tokenizer = train_tokenizer(["abcdefghij"], tmp_path / "tok")  # not the task's characters
    save_model(build_tiny_model(tokenizer, hidden_size=16, num_layers=1, num_heads=2,
                                intermediate_size=16, max_position_embeddings=64, seed=0),
               tokenizer, other)
    cfg = replace(cfg, {"model.reference": str(other)})
    fresh = run_id + "-fresh"
    with pytest.raises(TokenizerMismatch, match="vocab_size"):
        run_stage(store, cfg, fresh, "snapshot")
    assert store.list(RunKeys(fresh).root) == []  # nothing half-published


@pytest.mark.parametrize(("change", "field", "said"), [
    ({"model.reference": "initail"}, "model.reference", "does not exist"),
    ({"learner.lora": {"target_modules": ["nowhere"]}}, "learner.lora.target_modules",
     "names no module of the model; its modules are named"),
    ({"learner.lora": {"target_modules": ["q_proj", "mlp"]}}, "learner.lora.target_modules",
     "a LlamaMLP, which LoRA does not adapt"),
])
def test_a_setting_the_snapshot_can_check_fails_it_before_training(run, change, field, said):
    """A reference that is no folder (it would be looked up on the Hugging Face hub) and
    LoRA targets the model lacks used to fail only after SFT, or in the learner, which the
    runner then restarted in vain."""
    from shardrl.config import ConfigError

    store, cfg, run_id, _ = run
    cfg = replace(cfg, {**change, "model.sft.enabled": True})
    fresh = run_id + "-fresh"
    with pytest.raises(ConfigError) as info:
        run_stage(store, cfg, fresh, "snapshot")
    assert [e.path for e in info.value.errors] == [field] and said in str(info.value)
    assert store.list(RunKeys(fresh).root) == []


@pytest.mark.parametrize("head", ["causal-lm", "two-labels"])
def test_reward_model_with_the_wrong_head_is_refused(run, tmp_path, head):
    from transformers import LlamaForSequenceClassification

    from shardrl.stages.policy import load_policy

    store, cfg, run_id, _ = run
    model, tokenizer = load_policy(store, RunKeys(run_id), 0, tmp_path / "cache")
    folder = tmp_path / head
    if head == "two-labels":
        conf = model.config
        conf.num_labels, conf.architectures = 2, ["LlamaForSequenceClassification"]
        model = LlamaForSequenceClassification(conf)
    save_model(model, tokenizer, folder)
    cfg = replace(cfg, {"reward.reward_model": {"path": str(folder)}})
    from shardrl.stages.score import Scorer

    expected = "LlamaForCausalLM" if head == "causal-lm" else "num_labels=2"
    with pytest.raises(RewardModelError, match=expected):
        Scorer(context(store, cfg, run_id, "score"))


def test_invalid_config_lists_every_problem_and_creates_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("extends: demo\nlearner: {lr: -1.0, lrr: 3}\nrollout: {group_size: 1}\n")
    res = run_cli(["run", str(bad), "--store", str(tmp_path / "store"), "--no-progress"], tmp_path,
                  timeout=120)
    assert res.returncode == 1
    for path in ("learner.lr", "learner.lrr", "rollout.group_size"):
        assert path in res.stderr, res.stderr
    assert "3 error(s)" in res.stderr
    assert not (tmp_path / "store").exists()
    res = run_cli(["config", "validate", str(bad)], tmp_path, timeout=120)
    assert res.returncode != 0 and "rollout.group_size" in (res.stdout + res.stderr)


@pytest.mark.parametrize(("store", "message"), [
    ("afile", "Not a directory"),
    ("gs://bucket/x", "unsupported store URI scheme 'gs' in 'gs://bucket/x'"),
    ("s3://", "expected s3://bucket/prefix, got 's3://'"),
])
def test_a_store_that_cannot_be_opened_is_one_line(tmp_path, store, message):
    (tmp_path / "afile").write_text("")
    path = ["tiny.yaml"]
    (tmp_path / "tiny.yaml").write_text(CONFIG)
    res = run_cli(["run", *path, "--store", store, "--no-progress"], tmp_path, timeout=120)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert res.stderr.startswith("shardrl run: ") and message in res.stderr
    if "://" in store:
        res = run_cli(["doctor", "r1", "--store", store], tmp_path, timeout=120)
        assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert message in res.stderr


def test_a_failed_shard_write_stops_the_worker_even_when_a_later_write_succeeds(run, monkeypatch):
    """The writes of one generation batch run on a background thread; each is checked, not
    only the batch's last, so a lost shard can never pass for a written one."""
    store, cfg, run_id, _ = run
    from shardrl.stages.inline import InlinePostprocess

    cfg = replace(cfg, {"learner.batch_prompts": 6})  # a round of 3 shards in one batch
    written = []
    real_write = InlinePostprocess.write

    def write(self, key, *args):
        if not written:
            written.append(None)
            raise OSError(f"disk full writing {key}")
        written.append(key)
        return real_write(self, key, *args)

    monkeypatch.setattr(InlinePostprocess, "write", write)
    with pytest.raises(OSError, match="disk full writing .*w00-000000"):
        run_stage(store, cfg, run_id, "rollout")
    assert len(written) >= 2  # a later shard of the round was written after the failed one
    names = shards_by_name(store, RunKeys(run_id), ("rollouts", "ready"))
    assert "w00-000000.parquet" not in names and len(names) == len(written) - 1


def test_a_failed_shard_write_is_not_counted_in_the_saved_worker_state(run, monkeypatch):
    """The next batch's reservation stores counts that include the previous batch's shards,
    so it is written only after their writes succeeded: a lost shard never inflates the
    backlog a restarted worker reads (it would wait for groups that never arrive)."""
    store, cfg, run_id, _ = run
    from shardrl.stages.inline import InlinePostprocess

    cfg = replace(cfg, {"learner.batch_prompts": 6, "rollout.max_batch_shards": 1})

    def write(self, key, *args):
        raise OSError(f"disk full writing {key}")

    monkeypatch.setattr(InlinePostprocess, "write", write)
    with pytest.raises(OSError, match="disk full writing .*w00-000000"):
        run_stage(store, cfg, run_id, "rollout")
    state = WorkerState.read(store, RunKeys(run_id).worker_state(0))
    assert (state.next_seq, state.groups_written, state.kept_written) == (1, 0, 0)


def test_a_worker_stopped_while_paused_resumes_with_its_last_batch_counted(run, monkeypatch):
    """The counts that include a batch are stored once its shards are, before the worker
    waits on its backlog: a worker killed in that wait (most of its time when the learner
    sets the pace) resumes with them, instead of under-counting and running ahead of its cap."""
    store, cfg, run_id, _ = run
    from shardrl.stages import rollout

    seen = []  # (groups the worker counts, the stored state) at each pause

    def pause(self, timeout):
        seen.append((self.groups, self.kept,
                     WorkerState.read(store, RunKeys(run_id).worker_state(0))))

    monkeypatch.setattr(rollout.Flow, "full", lambda self, progress: self.groups > 0)
    monkeypatch.setattr(rollout.Flow, "pause", pause)
    monkeypatch.setattr(StageContext, "done", lambda self: len(seen) >= 1)
    ctx = context(store, cfg, run_id, "rollout")
    ctx.once = False
    rollout.main(ctx)
    groups, kept, state = seen[0]
    assert groups > 0  # one batch written before the pause
    assert (state.groups_written, state.kept_written) == (groups, kept)
    assert state.next_seq == len(shards_by_name(store, RunKeys(run_id), ("ready",)))


def test_a_worker_stopped_before_its_next_reservation_counts_its_last_batch(run, monkeypatch):
    """The counts that include a batch are stored with the next reservation, or as the
    worker pauses: one stopped between its batch's writes and either (here as it reads the
    learner's progress for the next batch) counts that batch's shards when it starts again,
    instead of running ahead of its cap by them for good."""
    import time

    from shardrl.stages import Stopped, rollout

    store, cfg, run_id, _ = run
    keys = RunKeys(run_id)
    reads = []
    real = rollout.Progress.read.__func__

    def read(cls, st, key, optional=False):
        if key == keys.progress():
            reads.append(key)
            if len(reads) == 2:  # the top of the second batch: the first one's writes queued
                time.sleep(0.5)  # (they finish meanwhile)
                raise Stopped(143)
        return real(cls, st, key, optional)

    monkeypatch.setattr(rollout.Progress, "read", classmethod(read))
    monkeypatch.setattr(rollout.Flow, "full", lambda self, progress: False)
    ctx = context(store, cfg, run_id, "rollout")
    ctx.once = False
    with pytest.raises(Stopped):
        rollout.main(ctx)
    shards = [read_shard(store, k, READY)
              for k in shards_by_name(store, keys, ("ready",)).values()]
    groups = sum(len(set(t.column("group_id").to_pylist())) for t in shards)
    kept = sum(len(set(t.filter(t.column("keep")).column("group_id").to_pylist()))
               for t in shards)
    stored = WorkerState.read(store, keys.worker_state(0))
    assert groups > 0 and (stored.groups_written, stored.reserved_from) == (0, 0)
    assert stored.next_seq == len(shards)
    # started again: its counts include the batch
    seen = []
    monkeypatch.setattr(rollout.Progress, "read", classmethod(real))
    monkeypatch.setattr(rollout.Flow, "full", lambda self, progress: seen.append(
        (self.groups, self.kept)) or True)
    monkeypatch.setattr(rollout.Flow, "pause", lambda self, timeout: None)
    monkeypatch.setattr(StageContext, "done", lambda self: len(seen) >= 1)
    ctx = context(store, cfg, run_id, "rollout")
    ctx.once = False
    rollout.main(ctx)
    assert seen == [(groups, kept)]
    again = WorkerState.read(store, keys.worker_state(0))  # stored as it paused
    assert (again.groups_written, again.kept_written, again.reserved_from) == (groups, kept, None)


def test_a_reserved_shard_that_does_not_read_counts_as_the_worker_will_take_it_away(run):
    """The worker takes a quarantined shard of its own away as an average shard
    (`Flow.check_lost`): one of its last batch that does not read is counted so when it
    starts again, or its counts would end a shard low."""
    from shardrl.stages.rollout import resumed_counts

    store, cfg, run_id, template = run
    keys = RunKeys(run_id)
    write_shard(store, keys.rollout(0, 0, 0), template, ROLLOUT)  # 2 prompt groups
    store.put_bytes(keys.rollout(0, 0, 1), b"PAR1 not really")
    state = WorkerState(next_seq=3, version=0, reserved_from=0)  # seq 2 never written
    counted = resumed_counts(context(store, cfg, run_id, "rollout"), state, inline=False)
    n = cfg.rollout.prompts_per_shard
    assert (counted.groups_written, counted.kept_written) == (2 + n, 2 + n)
    assert counted.reserved_from is None and counted.next_seq == 3


def test_a_worker_paused_long_moves_its_version_with_the_learner(run, monkeypatch):
    """Stages close the versions below every worker's stored version: a worker paused while
    the learner commits version after version (a standby worker, most of the run) stores the
    committed version every k versions, instead of holding every version since its pause
    open for every stage."""
    from shardrl.stages import rollout
    from shardrl.store.records import Progress

    store, cfg, run_id, _ = run
    keys = RunKeys(run_id)
    k = cfg.learner.max_staleness
    versions = iter(range(0, 3 * k + 1))
    stored = []
    real = rollout.Progress.read.__func__

    def read(cls, st, key, optional=False):
        if key == keys.progress():
            return Progress(version=next(versions))
        return real(cls, st, key, optional)

    def pause(self, timeout):
        stored.append(WorkerState.read(store, keys.worker_state(0)).version)

    monkeypatch.setattr(rollout.Progress, "read", classmethod(read))
    monkeypatch.setattr(rollout.Flow, "full", lambda self, progress: True)
    monkeypatch.setattr(rollout.Flow, "pause", pause)
    monkeypatch.setattr(StageContext, "done", lambda self: len(stored) >= 3 * k + 1)
    ctx = context(store, cfg, run_id, "rollout")
    ctx.once = False
    rollout.main(ctx)
    # stored at versions 0, k, 2k and 3k of the learner's, not on every commit
    assert stored == [0] * k + [k] * k + [2 * k] * k + [3 * k]


def test_a_failed_shard_write_stops_a_worker_about_to_pause(run, monkeypatch):
    """A worker whose backlog is full checks its last batch's writes before it waits: a
    failed write surfaces at once instead of leaving it paused on a backlog that counts the
    lost shard."""
    store, cfg, run_id, _ = run
    from shardrl.stages import rollout
    from shardrl.stages.inline import InlinePostprocess

    def write(self, key, *args):
        raise OSError(f"disk full writing {key}")

    pauses = []
    monkeypatch.setattr(InlinePostprocess, "write", write)
    monkeypatch.setattr(rollout.Flow, "full", lambda self, progress: self.groups > 0)
    monkeypatch.setattr(rollout.Flow, "pause", lambda self, timeout: pauses.append(timeout))
    monkeypatch.setattr(StageContext, "done", lambda self: len(pauses) >= 3)
    ctx = context(store, cfg, run_id, "rollout")
    ctx.once = False
    with pytest.raises(OSError, match="disk full writing .*w00-000000"):
        rollout.main(ctx)
    assert pauses == []
