"""`shardrl replay`: a run's learner re-run from its ledger publishes the same weights bit
for bit; a corrupted published tensor is found at its step; a loss change is a new run on
the same shards that `shardrl report` reads.

One short run of the tiny settings (the learner on 2 torch threads, recorded per step in the
ledger) is shared by the tests; each test that alters the store works on a copy.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from shardrl.cli import main as cli
from shardrl.stages.learn.replay import ledger_deltas
from shardrl.stages.policy import MANIFEST, fetch_weights
from shardrl.store import LocalStore, RunKeys
from shardrl.store.records import CheckpointPointer, ReplayCheck, ReplaySource

from .conftest import learner_metric, run_cli
from .rounds import one_thread, run_round, tiny_config

RUN = "src"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The store of a finished tiny run whose learner used 2 threads. The untrained policy
    rarely answers right, so a length penalty varies the rewards within a group: every step
    has advantages and changes the weights."""
    from .conftest import TINY

    root = tmp_path_factory.mktemp("replay")
    (root / "tiny.yaml").write_text(TINY + "tracking: {enabled: false}\n")
    r = run_cli(["run", "tiny.yaml", "--run-id", RUN, "--store", "store", "--no-progress",
                 "--set", "learner.threads=2", "--set", "reward.overlong={buffer_tokens: 4}"],
                root)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return root / "store"


def copy_of(store: Path, tmp_path: Path) -> Path:
    shutil.copytree(store, tmp_path / "store", ignore=shutil.ignore_patterns("logs"))
    return tmp_path / "store"


def replay(store: Path, *args: str) -> int:
    with one_thread():  # replay sets the recorded threads; the test process gets its own back
        return cli(["replay", RUN, "--store", str(store), *args])


def published(store: LocalStore, run: str) -> list[int]:
    keys = RunKeys(run)
    return [v for v in range(1, 100) if store.exists(keys.policy_file(v, MANIFEST))]


def test_replay_verifies_bit_for_bit_with_the_recorded_threads(source, tmp_path, monkeypatch,
                                                               capsys):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    root = copy_of(source, tmp_path)
    store, keys = LocalStore(root), RunKeys(RUN)
    deltas = ledger_deltas(store, keys)
    stepped = [d for d in deltas if d.stepped]
    assert len(stepped) == 6
    assert all(d.threads == [2, 2] and d.beta is not None and d.restart is None for d in stepped)
    assert all(d.applied for d in stepped)
    versions = published(store, RUN)
    assert len(versions) >= 3
    gone = versions[-1]  # a version the store no longer holds is listed, not checked
    for key in store.list(keys.policy_prefix(gone)):
        store.delete(key)
    assert replay(root, "--verify", "--run-id", "again") == 0
    out = capsys.readouterr().out
    check = ReplayCheck.read(store, RunKeys("again").replay_check())
    assert check.ok and check.checked == versions[:-1] and check.missing == [gone]
    assert f"bit-for-bit equal ({len(versions) - 1} versions)" in out
    first, last = fetch_weights(store, keys, versions[0]), fetch_weights(store, keys, versions[-2])
    assert any(not torch.equal(first[k], last[k]) for k in first)  # the steps changed weights
    assert f"deleted by retention: v{gone}" in out
    # the replay is a run of its own: the same shards in the same order, its own versions
    again = ledger_deltas(store, RunKeys("again"))
    assert [[e.key for e in d.shards] for d in again] == [[e.key for e in d.shards]
                                                          for d in deltas]
    assert [d.threads for d in again] == [d.threads for d in deltas]
    assert [d.beta for d in again] == [d.beta for d in deltas]
    assert ReplaySource.read(store, RunKeys("again").replay_source()).run_id == RUN
    assert store.exists(RunKeys("again").done())
    assert learner_metric(root, "again", "policy_loss") == learner_metric(root, RUN,
                                                                          "policy_loss")


def test_a_verify_with_nothing_left_to_compare_is_not_a_pass(source, tmp_path, monkeypatch,
                                                             capsys):
    """Retention deleted every version the replay makes: nothing was shown equal, and a CI
    check reading the exit status must not take it for a pass."""
    from shardrl.commands.replay_cmd import EXIT_UNVERIFIED

    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    root = copy_of(source, tmp_path)
    store, keys = LocalStore(root), RunKeys(RUN)
    for version in published(store, RUN):
        for key in store.list(keys.policy_prefix(version)):
            store.delete(key)
    assert replay(root, "--verify", "--run-id", "none-left") == EXIT_UNVERIFIED
    out = capsys.readouterr().out
    assert "verify: NOT VERIFIED" in out and "bit-for-bit equal" not in out
    # a run that committed nothing: nothing to replay, said as such (not "retention")
    from shardrl.store.records import Progress

    Progress().write(store, keys.progress())
    assert replay(root, "--verify", "--run-id", "nothing") == 2
    assert "has committed no version yet: nothing to replay" in capsys.readouterr().err
    assert store.list(RunKeys("nothing").root) == []


def test_an_update_the_run_skipped_is_told_from_one_it_applied(source, tmp_path, monkeypatch,
                                                                 capsys):
    """A `--once` round publishes a version whether or not its update changed the weights:
    the ledger says which, and a replay whose update was applied where the run's was skipped
    says so at that step, before any weights are compared."""
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    root = copy_of(source, tmp_path)
    store, keys = LocalStore(root), RunKeys(RUN)
    numbered = sorted(k for k in store.list(keys.ledger_prefix()) if k.endswith(".json"))
    at = None
    for key in numbered:
        delta = store.get_json(key)
        if delta["stepped"] and delta["version"] >= 2:
            delta["applied"] = False  # as a round whose rows were all filtered records it
            store.put_json(key, delta)
            at = delta["version"]
            break
    assert at is not None
    assert replay(root, "--verify", "--run-id", "skipped") == 3
    out = capsys.readouterr().out
    # named by the version the step started from, as the replay's other step checks are
    assert (f"DIFFERENT: v{at - 1}: the update was applied (the weights changed), the run's "
            "was not" in out)
    assert ReplayCheck.read(store, RunKeys("skipped").replay_check()).checked == list(
        range(1, at))


def corrupt(store: LocalStore, keys: RunKeys, version: int) -> str:
    """Add 1 to one element of one tensor published for `version`, in each of its weight
    files (the full weights, or the delta of new values, or both), as if the learner had
    computed it; the name of the model tensor that changes."""
    manifest = store.get_json(keys.policy_file(version, MANIFEST))
    files = {n: st_load(store.get_bytes(keys.policy_file(version, n)))
             for n in manifest["files"] if n.endswith(".safetensors")}
    # a tensor every file holds: the first floating one of the sparsest file
    fewest = min(files.values(), key=len)
    name = sorted(k for k, t in fewest.items() if t.is_floating_point())[0].split("/", 1)[-1]
    for file, tensors in files.items():
        for key in [k for k in tensors if k.split("/", 1)[-1] == name and
                    tensors[k].is_floating_point()]:
            tensors[key] = tensors[key].clone()
            tensors[key].view(-1)[0] += 1.0
        data = st_save(tensors)
        store.put_bytes(keys.policy_file(version, file), data)
        manifest["files"][file] = hashlib.sha256(data).hexdigest()
    store.put_json(keys.policy_file(version, MANIFEST), manifest)
    return name


def test_a_corrupted_tensor_is_reported_at_its_step(source, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    root = copy_of(source, tmp_path)
    store, keys = LocalStore(root), RunKeys(RUN)
    versions = published(store, RUN)
    bad = versions[len(versions) // 2]
    name = corrupt(store, keys, bad)
    assert replay(root, "--verify", "--run-id", "check") == 3
    out = capsys.readouterr().out
    check = ReplayCheck.read(store, RunKeys("check").replay_check())
    assert check.first_difference is not None
    assert (check.first_difference.version, check.first_difference.tensor,
            check.first_difference.elements) == (bad, name, 1)
    assert check.first_difference.max_abs_diff == pytest.approx(1.0)
    assert check.checked == [v for v in versions if v <= bad]  # it stops there
    assert f"DIFFERENT at step {bad} (policy v{bad}): tensor {name} (1 elements differ" in out
    # up to the version before it, the same run verifies
    assert replay(root, "--verify", "--to-version", str(bad - 1), "--run-id", "upto") == 0
    assert ReplayCheck.read(store, RunKeys("upto").replay_check()).checked == [
        v for v in versions if v < bad]


def test_a_loss_change_is_a_new_run_on_the_same_shards(source, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    root = copy_of(source, tmp_path)
    store = LocalStore(root)
    assert replay(root, "--verify", "--set", "algo.loss.kind=ppo") == 2  # verify needs no --set
    last = max(published(store, RUN))
    capsys.readouterr()
    assert replay(root, "--to-version", str(last + 1)) == 2  # used to re-learn all, silently
    assert capsys.readouterr().err.strip() == (
        f"shardrl replay: --to-version {last + 1} is past the run's last committed version, "
        f"{last}")
    assert replay(root, "--set", "rollout.temperature=0.5") == 2  # not a learner change
    capsys.readouterr()
    # settings the shards or the ledger fix: recorded in run.json, they would apply to nothing
    for item in ("algo.filters.zero_variance=false", "algo.shaping.alpha=5",
                 "learner.total_steps=3", "learner.max_staleness=0", "tracking.enabled=true",
                 "learner={lr: 0.1}", "algo.advantages.norm=batch", "algo.kl.placement=loss"):
        assert replay(root, "--set", item) == 2, item
        assert f"--set {item}: a replay cannot change it" in capsys.readouterr().err
    assert not [k for k in store.list("runs/") if not k.startswith(f"runs/{RUN}/")]
    assert replay(root, "--set", "algo.loss.kind=gspo", "--run-id", "gspo") == 0
    capsys.readouterr()
    src, gspo = RunKeys(RUN), RunKeys("gspo")
    assert store.get_json(gspo.run_json())["config"]["algo"]["loss"]["kind"] == "gspo"
    assert ReplaySource.read(store, gspo.replay_source()).overrides == ["algo.loss.kind=gspo"]
    assert [[e.key for e in d.shards] for d in ledger_deltas(store, gspo)] == [
        [e.key for e in d.shards] for d in ledger_deltas(store, src)]
    # the same shards, another loss (sequence-level, length-normalised): other weights (not
    # at v1: Adam's first step moves each weight by the learning rate times the sign of its
    # gradient, which both losses share) and its own metrics
    assert any(not torch.equal(a, fetch_weights(store, src, 6)[k])
               for k, a in fetch_weights(store, gspo, 6).items())
    losses = learner_metric(root, "gspo", "policy_loss")
    assert len(losses) == 6 and losses != learner_metric(root, RUN, "policy_loss")
    # evaluated as the evaluate stage owes it, so the report compares it with the source
    assert [store.get_json(gspo.eval_summary(v))["version"] for v in (0, 3, 6)] == [0, 3, 6]
    assert cli(["report", "gspo", "--store", str(root)]) == 0
    assert (root / "runs" / "gspo" / "report" / "index.html").exists()


def test_a_learner_restart_is_repeated_as_it_happened(tmp_path, monkeypatch, capsys):
    """Each `--once` learn round is a new learner process resuming from the store, from the
    checkpoint its previous round wrote. Before the last round that checkpoint is removed, as
    if a learner checkpointing every 2 steps had crashed after step 3: the last round resumes
    with the optimizer moments of step 2, which a learner running through would not. The
    ledger records each restart and the replay resumes where the run did."""
    monkeypatch.setenv("SHARDRL_CACHE", str(tmp_path / "cache"))
    cfg = tiny_config(tmp_path, overrides=(
        "rollout.workers=1", "learner.total_steps=4", "learner.ckpt_every=2",
        "reward.overlong={buffer_tokens: 4}"))
    root = tmp_path / "store"
    store, keys = LocalStore(root), RunKeys(RUN)
    with one_thread():
        run_round(store, cfg, RUN, "snapshot")
        for step in range(4):
            if step == 3:
                for key in store.list(keys.learner_prefix(3)):
                    store.delete(key)
                CheckpointPointer(step=2).write(store, keys.latest_learner())
            run_round(store, cfg, RUN, "rollout")
            run_round(store, cfg, RUN, "learn")
    deltas = ledger_deltas(store, keys)
    assert deltas[0].restart is None and all(d.restart is not None for d in deltas[1:])
    assert deltas[-1].version == 4 and deltas[-1].restart.checkpoint == 2
    assert replay(root, "--verify", "--run-id", "again") == 0
    assert ReplayCheck.read(store, RunKeys("again").replay_check()).checked == [1, 2, 3, 4]
    # without the restarts in the ledger, the replay trains through and differs
    for n, d in enumerate(deltas, start=1):
        store.put_json(keys.ledger(n), d.model_copy(update={"restart": None}).model_dump(
            mode="json"))
    assert replay(root, "--verify", "--run-id", "through") == 3
    assert ReplayCheck.read(store, RunKeys("through").replay_check()).first_difference.version > 1
    capsys.readouterr()
    for n, d in enumerate(deltas, start=1):  # the ledger as the run wrote it
        store.put_json(keys.ledger(n), d.model_dump(mode="json"))
    # another checkpoint schedule lacks the step-2 checkpoint the run resumed from: a
    # departure, told, and the replay goes on with its own state through every commit
    assert replay(root, "--set", "learner.ckpt_every=3", "--no-eval", "--run-id", "every3") == 0
    err = capsys.readouterr().err
    assert "departed from src's record at v3: the run's learner resumed with the optimizer " \
        "state of step 2" in err, err
    assert published(store, "every3")[-1] == 4
    # a replay that fails leaves nothing of its run behind: the id stays free
    assert replay(root, "--set", "learner.lora={target_modules: [nowhere]}",
                  "--run-id", "bad") == 1  # no module of the model matches
    assert store.list(RunKeys("bad").root) == []
    err = capsys.readouterr().err
    assert "objects of run bad it had written are removed" in err
    assert "learner.lora.target_modules: " in err and "nowhere" in err
