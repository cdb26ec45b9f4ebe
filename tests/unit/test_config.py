"""Run config: presets validate, typos get suggestions, cross-field rules say what to change."""

import subprocess
import sys
from pathlib import Path

import pytest

from shardrl.cli import build_parser
from shardrl.config import ConfigError, RunConfig, load_config, preset_names, validate

REPO = Path(__file__).resolve().parents[2]


def test_config_import_pulls_no_heavy_modules():
    code = "import sys, shardrl.config; print([m for m in ('torch', 'transformers') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["demo", "scalerl", "ppo-rlhf"])
def test_every_preset_validates(name):
    assert name in preset_names()
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")))
def test_every_shipped_config_validates(path):
    load_config(path)


def test_presets_carry_their_recipes():
    scalerl = load_config("scalerl")
    assert scalerl.algo.loss.kind == "cispo"
    assert scalerl.algo.aggregation == "prompt"
    assert scalerl.learner.max_staleness == 8
    assert scalerl.algo.filters.no_positive_resampling.enabled
    rlhf = load_config("ppo-rlhf")
    assert rlhf.algo.advantages.estimator == "gae" and rlhf.algo.critic is not None
    assert rlhf.algo.kl.controller.kind == "adaptive"
    assert rlhf.reward.verifiers == [] and rlhf.reward.reward_model is not None


def _errors(data):
    with pytest.raises(ConfigError) as info:
        validate(data)
    return info.value.errors


def test_typo_gets_a_suggestion_with_its_path():
    (err,) = _errors({"learner": {"lrr": 1e-3}})
    assert err.path == "learner.lrr"
    assert "did you mean 'lr'" in err.message


def test_typo_inside_a_union_variant():
    """The path is the key as typed: pydantic's location holds the variant's name too
    (`algo.loss.cispo.max_rato`), which is no key a user can set."""
    (err,) = _errors({"algo": {"loss": {"kind": "cispo", "max_rato": 3.0}}})
    assert err.path == "algo.loss.max_rato" and "did you mean 'max_ratio'" in err.message
    (err,) = _errors({"algo": {"kl": {"controller": {"kind": "adaptive", "beta": 0.1}}}})
    assert err.path == "algo.kl.controller.beta" and "did you mean 'init_beta'" in err.message
    with pytest.raises(ConfigError) as info:  # merged into the preset's ppo section
        load_config("demo", ["algo.loss.knd=gspo"])
    (err,) = info.value.errors
    assert err.path == "algo.loss.knd" and "did you mean 'kind'" in err.message


def test_a_text_setting_takes_its_value_as_text():
    """YAML reads `2024` as a number, `on` as a boolean and `a: b` as a mapping; a setting
    that holds text takes what was typed."""
    from shardrl.config import apply_override

    assert load_config("demo", ["name=2024"]).name == "2024"
    assert load_config("demo", ["name=on"]).name == "on"
    assert apply_override({}, "task.system_prompt=Answer: 42") == {
        "task": {"system_prompt": "Answer: 42"}}
    assert apply_override({}, "task.system_prompt=null") == {"task": {"system_prompt": None}}
    assert apply_override({}, "seed=7") == {"seed": 7}  # not text: YAML as before
    # a list or a mapping of text is not text
    assert apply_override({}, "pipeline.pod.image_pull_secrets=[regcred]") == {
        "pipeline": {"pod": {"image_pull_secrets": ["regcred"]}}}
    assert apply_override({}, "pipeline.pod.gpu_node_selector={pool: a100}") == {
        "pipeline": {"pod": {"gpu_node_selector": {"pool": "a100"}}}}
    with pytest.raises(ConfigError, match="not valid YAML"):
        apply_override({}, "learner.lr=[a")


def test_a_config_name_that_is_no_file_suggests_a_preset():
    with pytest.raises(ConfigError, match="did you mean the preset 'demo'"):
        load_config("dem")
    with pytest.raises(ConfigError, match=r"nor a preset \(presets: calculator, demo"):
        load_config("nothing.yaml")


def test_typo_inside_a_list_item():
    (err,) = _errors({"reward": {"verifiers": [{"name": "task"}, {"nam": "task"}]}})
    assert err.path == "reward.verifiers.1.nam" and "did you mean 'name'" in err.message


def test_every_error_is_listed():
    errs = _errors({"learner": {"lr": -1, "total_steps": 0}, "rollout": {"group_size": 1}})
    paths = sorted(e.path for e in errs)
    assert paths == ["learner.lr", "learner.total_steps", "rollout.group_size"]


def test_gae_requires_a_critic():
    (err,) = _errors({"algo": {"advantages": {"estimator": "gae"}}})
    assert "needs a critic" in err.message and "algo.critic" in err.message


def test_value_clipping_is_refused_as_a_no_op():
    critic = {"advantages": {"estimator": "gae"}, "critic": {"clip_range": 0.2}}
    (err,) = _errors({"algo": critic})
    assert "clip_range" in err.message and "one update" in err.message
    assert validate({"algo": {**critic, "critic": {}}}).algo.critic.clip_range is None


def test_k1_in_the_loss_is_refused_and_allowed_in_the_reward():
    (err,) = _errors({"algo": {"kl": {"placement": "loss", "estimator": "k1"}}})
    assert "zero expected gradient" in err.message and "k2" in err.message
    assert validate({"algo": {"kl": {"placement": "reward", "estimator": "k1"}}}).algo.kl.estimator == "k1"
    assert validate({"algo": {"kl": {"placement": "loss", "estimator": "k2"}}}).algo.kl.estimator == "k2"


def test_nucleus_sampling_is_refused_for_training_rollouts():
    """The rollout records the nucleus's renormalised log-probabilities; the learner trains
    the full softmax: an on-policy token's importance ratio would be the nucleus's mass."""
    (err,) = _errors({"rollout": {"top_p": 0.9}})
    assert err.path == "rollout"
    assert "rollout.top_p 0.9 < 1" in err.message and "nucleus's mass" in err.message
    assert "rollout.temperature" in err.message
    assert validate({"rollout": {"top_p": 1.0}}).rollout.top_p == 1.0


def test_kl_placement_requires_a_reference():
    (err,) = _errors({"model": {"reference": "none"}, "algo": {"kl": {"placement": "loss"}}})
    assert "needs a reference model" in err.message and "model.reference" in err.message


def test_problems_across_sections_are_listed_each_under_the_setting_it_names():
    errors = _errors({"model": {"reference": "none"}, "algo": {"kl": {"placement": "loss"}},
                      "eval": {"every": 10_000}, "rollout": {"max_turns": 3}})
    assert [e.path for e in errors] == ["model.reference", "eval.every", "rollout.max_turns"]
    assert errors[1].message.startswith("`eval.every` (10000) exceeds `learner.total_steps`")
    assert "; " not in errors[0].message and "eval.every" not in errors[0].message


def test_reward_needs_a_source():
    (err,) = _errors({"reward": {"verifiers": []}})
    assert "reward.verifiers" in err.message


def test_heads_must_divide_width():
    (err,) = _errors({"model": {"source": {"kind": "tiny", "hidden_size": 130, "num_heads": 4}}})
    assert "num_heads" in err.message


def test_vllm_needs_gpu_resources():
    rollout, evaluate = _errors({"rollout": {"engine": "vllm"}})
    assert rollout.path == "pipeline.resources.rollout.gpus"
    # evaluate builds a vLLM engine too: it needs its own GPU
    assert evaluate.path == "pipeline.resources.evaluate.gpus"
    (err,) = _errors({"rollout": {"engine": "vllm"},
                      "pipeline": {"resources": {"rollout": {"gpus": 1}}}})
    assert "stage evaluate" in err.message and "stage rollout" not in err.message
    cfg = validate({"rollout": {"engine": "vllm"}, "pipeline": {"resources": {
        "rollout": {"gpus": 1}, "evaluate": {"gpus": 1}}}})
    assert cfg.rollout.engine == "vllm"


def test_learner_ranks_cannot_exceed_its_gpus():
    (err,) = _errors({"learner": {"backend": {"kind": "deepspeed", "ranks": 4}},
                      "pipeline": {"resources": {"learn": {"gpus": 2}}}})
    assert "pipeline.resources.learn.gpus: 4" in err.message
    # on CPU (no GPUs requested) any number of ranks is allowed
    cfg = validate({"learner": {"backend": {"kind": "deepspeed", "ranks": 4}}})
    assert cfg.learner.backend.ranks == 4


def test_extends_file_and_overrides(tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("extends: demo\nlearner: {lr: 0.002}\n")
    child = tmp_path / "child.yaml"
    child.write_text("extends: base.yaml\nalgo:\n  loss: {kind: cispo, max_ratio: 2.0}\n")
    cfg = load_config(child, ["learner.total_steps=7", "eval.every=7"])
    assert cfg.learner.lr == 0.002
    assert cfg.learner.total_steps == 7
    # switching the variant replaces the parent's loss mapping rather than merging into it
    assert load_config("demo").algo.loss.kind == "ppo"
    assert cfg.algo.loss.kind == "cispo" and cfg.algo.loss.max_ratio == 2.0
    assert not hasattr(cfg.algo.loss, "eps_high")


def test_yaml_merge_keys_work_and_keys_given_twice_are_still_refused(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("extends: demo\nx-limits: &limits {cpu_seconds: 3.0, wall_seconds: 6.0}\n"
                 "reward:\n  sandbox: {<<: *limits, wall_seconds: 7.0}\n")
    from shardrl.config.loader import load_raw

    data = load_raw(f)
    data.pop("x-limits")
    sandbox = validate(data).reward.sandbox
    assert (sandbox.cpu_seconds, sandbox.wall_seconds) == (3.0, 7.0)
    f.write_text("extends: demo\nlearner: {lr: 0.1}\nlearner: {lr: 0.2}\n")
    with pytest.raises(ConfigError, match="appears twice"):
        load_config(f)


def test_numbers_are_read_as_yaml_1_2_reads_them(tmp_path):
    """YAML 1.1 (PyYAML's) read `seed: 010` as octal 8 and `1:30` as 90, and left `1e-4` as
    text: in a file and in `--set` alike."""
    from shardrl.config.loader import parse_yaml

    read = parse_yaml("a: 010\nb: 0o10\nc: 0x1F\nd: 1_000\ne: -010\nf: 1:30\ng: 1e-4\n"
                      "h: -1.5E+3\ni: .5\nj: .inf\nk: 0b11\nl: 1.2.3\nm: 09\n", "test")
    assert read == {"a": 10, "b": 8, "c": 31, "d": 1000, "e": -10, "f": "1:30", "g": 1e-4,
                    "h": -1500.0, "i": 0.5, "j": float("inf"), "k": "0b11", "l": "1.2.3",
                    "m": 9}
    assert [type(read[k]) for k in "adg"] == [int, int, float]
    f = tmp_path / "c.yaml"
    f.write_text("extends: demo\nseed: 010\n")
    assert load_config(f).seed == 10
    assert load_config("demo", ["seed=010"]).seed == 10
    assert load_config("demo", ["learner.total_steps=0o20"]).learner.total_steps == 16
    # what the project writes (a run's config.yaml, `config show`, the pipeline's parameter)
    # reads back: text that YAML 1.2 reads as a number is quoted
    from shardrl.config.loader import dump_yaml

    cfg = load_config("demo", ["name=1e5", "tracking.experiment=09"])
    assert (cfg.name, cfg.tracking.experiment) == ("1e5", "09")
    f.write_text(dump_yaml(cfg.model_dump(mode="json")))
    assert "name: '1e5'" in f.read_text() and load_config(f) == cfg
    # a decimal past Python's limit on digits is a config error, not a crash
    with pytest.raises(ConfigError, match="as a number"):
        parse_yaml("a: 0" + "9" * 5000, "test")


def test_booleans_are_read_as_yaml_1_2_reads_them(tmp_path):
    """YAML 1.1 read `yes`, `no`, `on` and `off` as booleans, so `name: no` in a file was
    refused as not text; only `true` and `false` are booleans now, and a boolean setting
    still takes the words."""
    from shardrl.config.loader import dump_yaml, parse_yaml

    read = parse_yaml("a: yes\nb: No\nc: on\nd: OFF\ne: true\nf: False\ng: TRUE\nh: tRue\n"
                      "i: y\nj: trueno\nk: False-start\n", "test")
    assert read == {"a": "yes", "b": "No", "c": "on", "d": "OFF", "e": True, "f": False,
                    "g": True, "h": "tRue", "i": "y", "j": "trueno", "k": "False-start"}
    assert load_config("demo", ["name=true-baseline"]).name == "true-baseline"
    f = tmp_path / "c.yaml"
    f.write_text("extends: demo\nname: no\nmodel: {fp32_lm_head: off}\n"
                 "tracking: {experiment: falsehood}\n")
    cfg = load_config(f)
    assert (cfg.name, cfg.model.fp32_lm_head) == ("no", False)
    assert cfg.tracking.experiment == "falsehood"
    assert load_config("demo", ["model.fp32_lm_head=on"]).model.fp32_lm_head is True
    # written back, the word is quoted: any YAML 1.1 reader takes it as text too
    f.write_text(dump_yaml(cfg.model_dump(mode="json")))
    assert "name: 'no'" in f.read_text() and load_config(f) == cfg


def test_overrides_that_switch_a_variant_do_not_depend_on_their_order():
    """A setting of the new variant given before the switch used to be dropped silently."""
    for items in (["algo.loss.eps_low=0.001", "algo.loss.kind=gspo"],
                  ["algo.loss.kind=gspo", "algo.loss.eps_low=0.001"]):
        loss = load_config("demo", items).algo.loss
        assert (loss.kind, loss.eps_low) == ("gspo", 0.001), items
    # the same key twice: the later wins, as before
    assert load_config("demo", ["learner.lr=0.1", "learner.lr=0.2"]).learner.lr == 0.2
    assert load_config("demo", ["algo.loss.kind=gspo", "algo.loss.kind=cispo"]).algo.loss.kind \
        == "cispo"


def test_unknown_preset_suggests(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("extends: scalrl\n")
    with pytest.raises(ConfigError, match="did you mean 'scalerl'"):
        load_config(f)


def test_responses_must_leave_room_for_a_prompt_in_a_tiny_models_context():
    tiny = {"source": {"kind": "tiny", "max_position_embeddings": 32}}
    (err,) = _errors({"model": tiny, "rollout": {"max_new_tokens": 100}})
    assert "`rollout.max_new_tokens` (100) leaves no room for a prompt" in err.message
    (err,) = _errors({"model": tiny, "eval": {"max_new_tokens": 32}})
    assert "`eval.max_new_tokens` (32)" in err.message
    assert validate({"model": tiny, "rollout": {"max_new_tokens": 31}}).rollout.max_new_tokens == 31


def test_a_boolean_is_not_taken_for_a_number():
    (err,) = _errors({"learner": {"lr": True}})
    assert err.path == "learner" and "`lr` expects a number, got the boolean true" in err.message
    (err,) = _errors({"learner": {"micro_batch": False}})  # an optional number
    assert "`micro_batch` expects a number" in err.message
    cfg = validate({"algo": {"filters": {"zero_variance": False}}})  # a boolean field
    assert cfg.algo.filters.zero_variance is False


def test_a_key_given_twice_is_refused_not_dropped(tmp_path):
    f = tmp_path / "c.yaml"
    # plain YAML keeps the last `learner:` and drops lr 5e-4 without a word
    f.write_text("extends: demo\nlearner: {lr: 5.0e-4}\nrollout: {workers: 1}\n"
                 "learner: {total_steps: 30}\n")
    with pytest.raises(ConfigError, match=r"the key 'learner' appears twice \(also at line 2\)"):
        load_config(f)
    f.write_text("extends: demo\nlearner:\n  lr: 5.0e-4\n  lr: 1.0e-3\n")  # nested too
    with pytest.raises(ConfigError, match="the key 'lr' appears twice"):
        load_config(f)


def test_unreadable_files_and_bad_override_values_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot be read as text"):
        load_config(tmp_path)  # a folder
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"\xff\xfe\x00learner")
    with pytest.raises(ConfigError, match="cannot be read as text"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"learner.lr: value '\[1' is not valid YAML"):
        load_config("demo", ["learner.lr=[1"])


def test_cli_validate_exits_nonzero_listing_errors(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("extends: demo\nlearner: {lr: -1, totl_steps: 3}\n")
    res = subprocess.run([sys.executable, "-m", "shardrl.cli", "config", "validate", str(f)],
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert "learner.lr" in res.stderr and "did you mean 'total_steps'" in res.stderr


def test_config_hash_is_stable_and_sensitive():
    a, b = load_config("demo"), load_config("demo")
    assert a.config_hash() == b.config_hash()
    assert load_config("demo", ["learner.lr=0.5"]).config_hash() != a.config_hash()


@pytest.mark.parametrize("name,value", [("micro_batch", 4), ("micro_batch_tokens", 4096)])
def test_micro_batches_need_the_torch_backend_and_group_advantages(name, value):
    (err,) = _errors({"learner": {name: value, "backend": {"kind": "deepspeed"}}})
    assert f"learner.{name}" in err.message and "kind: torch" in err.message
    with pytest.raises(ConfigError) as info:  # the PPO-RLHF recipe: GAE with a critic
        load_config("ppo-rlhf", [f"learner.{name}={value}"])
    (err,) = info.value.errors
    assert f"`learner.{name}` does not support GAE" in err.message


def test_verifier_and_environment_names_are_checked_before_anything_runs(tmp_path):
    """A misspelt verifier or environment used to validate and then fail every rollout
    worker after the snapshot; a sandboxed `task` verifier likewise."""
    with pytest.raises(ConfigError) as caught:
        load_config("demo", ["reward.verifiers=[{name: exact_mach}]"])
    assert "verifier 'exact_mach' is neither a registered name (did you mean 'exact_match'?)" \
        in str(caught.value)
    with pytest.raises(ConfigError, match="did you mean 'calculator'"):
        load_config("demo", ["task.environment=calculatr"])
    with pytest.raises(ConfigError, match="the task's own checker runs in process"):
        load_config("demo", ["reward.verifiers=[{name: task, sandboxed: true}]"])
    ok = load_config("demo", ["reward.verifiers=[{name: python_exec}, {name: 'my.mod:fn', "
                              "sandboxed: true}]", "task.environment=pkg.envs:Shop"])
    assert [v.name for v in ok.reward.verifiers] == ["python_exec", "my.mod:fn"]
    # the config's lists are the registries' (the config package does not import them)
    from shardrl.config.data import ENVIRONMENT_NAMES, VERIFIER_NAMES
    from shardrl.tasks.environments import ENVIRONMENTS
    from shardrl.tasks.rewards import TASK_VERIFIER
    from shardrl.tasks.verifiers import SANDBOXED_ONLY, VERIFIERS

    assert set(VERIFIER_NAMES) == {TASK_VERIFIER} | set(VERIFIERS) | SANDBOXED_ONLY
    assert set(ENVIRONMENT_NAMES) == set(ENVIRONMENTS)


def test_the_runner_finds_user_code_before_the_snapshot(tmp_path, capsys, monkeypatch):
    """A dotted path whose module is not on the import path stops `shardrl run` in one line,
    before anything is trained, and leaves the run id free; one that is found runs none of
    its code here."""
    from shardrl.cli import main as cli_main
    from shardrl.orchestrate.local import find_user_code

    store = tmp_path / "store"
    code = cli_main(["run", "demo", "--store", str(store), "--run-id", "u1", "--no-report",
                     "--set", "reward.verifiers=[{name: 'nowhere.mod:fn', sandboxed: true}]"])
    assert code == 1
    err = capsys.readouterr().err
    assert "cannot load verifier 'nowhere.mod:fn': no module named 'nowhere' on the" in err
    assert not (store / "runs" / "u1" / "run.json").exists()
    assert not (store / "runs" / "u1" / "state" / "runner" / "started.json").exists()
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("raise SystemExit('imported')\n")
    (tmp_path / "userpkg" / "envs.py").write_text("raise SystemExit('imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    find_user_code(load_config("demo", ["task.environment=userpkg.envs:Shop",
                                        "reward.verifiers=[{name: 'userpkg.envs:f'}]"]))
    with pytest.raises(Exception, match="cannot load environment 'userpkg.nope:Shop': no "
                                        "module named 'userpkg.nope'"):
        find_user_code(load_config("demo", ["task.environment=userpkg.nope:Shop"]))
    # found through an editable install's finder, and in a namespace package (no
    # __init__.py), where the folder search alone would not tell: not refused
    (tmp_path / "space" / "rl").mkdir(parents=True)
    (tmp_path / "space" / "rl" / "verifiers.py").write_text("raise SystemExit('imported')\n")
    find_user_code(load_config("demo", ["reward.verifiers=[{name: 'shardrl.tasks.verifiers:"
                                        "numeric'}, {name: 'space.rl.verifiers:f'}]"]))


def test_a_partial_variant_section_says_which_key_names_the_variant(tmp_path):
    """A section of a variant (the loss, the backend, ...) that a config gives in part, where
    no preset named its variant, used to fail with pydantic's 'Unable to extract tag'."""
    config = tmp_path / "partial.yaml"
    config.write_text("algo: {loss: {max_ratio: 8}}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(str(config))
    assert ("algo.loss: name a variant: set `kind` to one of cispo, ppo, gspo, dppo_tv, "
            "dppo_kl (the default section is `kind: cispo`") in str(caught.value)
    with pytest.raises(ConfigError, match="'zero' is not a variant: set `kind` to one of "
                                          "torch, deepspeed"):
        load_config("demo", ["learner.backend={kind: zero, zero_stage: 2}"])
    # a preset that names the variant lets a config change a field alone
    assert load_config("scalerl", ["algo.loss={max_ratio: 8}"]).algo.loss.max_ratio == 8


def test_an_inline_config_is_read_as_a_config_file_is(tmp_path, capsys):
    """The Kubeflow `config` parameter may be YAML text: a key given twice, a list or invalid
    YAML is a config error in one message (a stage exits 2, no traceback), and a one-line
    `extends: NAME` is a config, not a file name."""
    from shardrl.cli import main as cli_main
    from shardrl.stages.context import load_stage_config

    with pytest.raises(ConfigError, match="the key 'learner' appears twice"):
        load_stage_config("learner:\n  lr: 1.0e-3\nlearner:\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_stage_config("- a\n- b\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_stage_config("learner: {lr: [\n")
    assert load_stage_config("extends: scalerl").name == "scalerl"
    assert load_stage_config("demo").name == "demo"
    for supervise in ([], ["--supervise"]):
        code = cli_main(["stage", "learn", *supervise, "--config", "- a\n", "--run-id", "x",
                         "--store", str(tmp_path / "store")])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("shardrl stage learn: invalid config <inline config>")
    assert not (tmp_path / "store").exists()


def test_a_replicated_stage_refuses_a_config_asking_for_other_replicas(tmp_path, capsys):
    """A pipeline compiled for 2 rollout workers, run with a pasted config asking for 3: the
    stages downstream would wait for a worker that never starts. The stage (and its
    supervisor, before any restart) refuse it; a stage run by hand as one worker of several
    (no --workers) is not checked."""
    from shardrl.cli import main as cli_main
    from shardrl.stages import replicas_refused

    store = str(tmp_path / "store")
    for supervise in ([], ["--supervise"]):
        code = cli_main(["stage", "rollout", *supervise, "--config", "demo", "--set",
                         "rollout.workers=3", "--run-id", "x", "--store", store,
                         "--worker", "1", "--workers", "2"])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith("shardrl stage rollout: started as one of 2 replicas, but the "
                              "run's config asks for 3 (rollout.workers)")
    assert not (tmp_path / "store").exists()
    args = build_parser().parse_args(["stage", "rollout", "--config", "demo", "--run-id", "x"])
    args.workers_stated, args.workers = False, 1  # as `cli.main` sets them
    assert replicas_refused(args, load_config("demo")) is None  # demo: 2 workers, not stated
    args.workers_stated, args.workers = True, 2
    assert replicas_refused(args, load_config("demo")) is None


def test_a_pipeline_stage_refuses_a_config_that_needs_other_stages(tmp_path, capsys):
    """A pipeline compiled from `demo` (rollout scores inline: no score or prepare task) run
    with a pasted `scalerl` config: the learner would wait for ever for ready shards no task
    writes. Every stage, and its supervisor, refuses it before touching the store."""
    from shardrl.cli import main as cli_main
    from shardrl.graph import active
    from shardrl.stages import stages_refused

    demo = ",".join(s.name for s in active(load_config("demo")))
    assert demo == "snapshot,rollout,learn,evaluate,promote"
    store = str(tmp_path / "store")
    for supervise in ([], ["--supervise"]):
        code = cli_main(["stage", "learn", *supervise, "--config", "scalerl", "--run-id", "x",
                         "--store", store, "--stages", demo])
        err = capsys.readouterr().err
        assert code == 2, err
        assert err.startswith(
            "shardrl stage learn: the pipeline was compiled with the stages snapshot, rollout, "
            "learn, evaluate, promote, but the run's config needs score, prepare, which the "
            "pipeline has no task for"), err
    assert not (tmp_path / "store").exists()
    args = build_parser().parse_args(["stage", "learn", "--config", "demo", "--run-id", "x",
                                      "--stages", demo])
    assert stages_refused(args, load_config("demo")) is None
    assert "has no use for score, prepare" in stages_refused(
        build_parser().parse_args(["stage", "learn", "--config", "demo", "--run-id", "x",
                                   "--stages", demo.replace("rollout", "rollout,score,prepare")]),
        load_config("demo"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage", "learn", "--config", "demo", "--run-id", "x",
                                   "--stages", "snapshot,lern"])
    assert "lern: name stages among" in capsys.readouterr().err


def test_compiling_with_a_bad_config_or_tag_is_one_message(tmp_path, capsys):
    from pipelines.shardrl import main as compile_main
    from shardrl.cli import main as cli_main

    typo = tmp_path / "typo.yaml"
    typo.write_text("learner: {lrr: 1}\n")
    assert compile_main([str(typo), "--out-dir", str(tmp_path / "out")]) == 1
    assert "learner.lrr: unknown key 'lrr'; did you mean 'lr'?" in capsys.readouterr().err
    assert cli_main(["pipeline", "compile", "--image-tag", "latest", "--out-dir",
                     str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err == ("shardrl pipeline: image tag 'latest' is not reproducible: "
                                       "use the package version\n")


def test_a_dataset_prompt_template_holds_prompt_alone():
    """A stray brace used to fail every stage with a KeyError; a template without {prompt}
    made every prompt the same string."""
    from shardrl.config import RunConfig

    def check(template):
        return RunConfig.model_validate({"task": {"source": {
            "kind": "dataset", "train_path": "a.jsonl", "eval_path": "b.jsonl",
            "prompt_template": template}}})

    assert check('Reply as {{"answer": N}}. {prompt}').task.source.prompt_template
    for template, said in (('Reply as {"answer": N}. {prompt}', "write literal braces as"),
                           ("Solve the sum.", "must hold {prompt}"),
                           ("Q: {prompt", "is not a format string"),
                           ("{prompt:.0}", "write {prompt} alone"),  # every prompt emptied
                           ("{prompt!r}", "write {prompt} alone")):
        with pytest.raises(ValueError, match=said):
            check(template)
