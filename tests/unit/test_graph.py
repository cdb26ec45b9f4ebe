"""The stage graph is the one source of the pipeline's shape: every derived view follows it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from shardrl.cli import build_parser
from shardrl.config import RunConfig
from shardrl.graph import (
    STAGE_NAMES,
    active,
    after_loop,
    before_loop,
    consumer,
    stage,
    upstream,
)

SRC = Path(__file__).resolve().parents[2] / "src"


def cfg(**sections) -> RunConfig:
    return RunConfig.model_validate({"tracking": {"enabled": False}, **sections})


def test_stage_shards_chain_from_rollouts_to_ready():
    assert [(s.name, s.reads, s.writes) for s in active(cfg(rollout={"postprocess": "stages"}))
            if s.reads or s.writes] == [
        ("rollout", None, "rollouts"), ("score", "rollouts", "scored"),
        ("prepare", "scored", "ready"), ("learn", "ready", None)]
    assert consumer("scored").name == "prepare"
    assert consumer("ready").name == "learn"


def test_upstream_follows_where_scoring_and_prepare_run():
    staged = cfg(rollout={"postprocess": "stages"})
    assert [upstream(n, staged) for n in ("score", "prepare", "learn")] == [None, "score", "prepare"]
    inline = cfg(rollout={"postprocess": "inline"})
    assert upstream("learn", inline) is None  # the workers close versions themselves
    assert [s.name for s in active(inline)] == ["snapshot", "rollout", "learn", "evaluate",
                                                "promote"]
    with pytest.raises(ValueError, match="reads no shards"):
        upstream("rollout", staged)


def test_one_shot_stages_split_around_the_loop():
    c = cfg()
    assert [s.name for s in before_loop(c)] == ["snapshot"]
    assert [s.name for s in after_loop(c)] == ["promote"]


def test_replicas_threads_ranks_and_images_come_from_config_fields():
    c = cfg(rollout={"workers": 3, "threads": 2, "postprocess": "stages"},
            learner={"threads": 4})
    assert stage("rollout").replicas(c) == 3 and stage("learn").replicas(c) == 1
    assert stage("rollout").threads(c) == 2 and stage("learn").threads(c) == 4
    assert stage("prepare").threads(c) == 1
    assert stage("learn").ranks(c) == 1 and stage("learn").image(c) == "base"
    ds = cfg(learner={"backend": {"kind": "deepspeed", "ranks": 2}},
             pipeline={"resources": {"learn": {"gpus": 2}}})
    assert stage("learn").ranks(ds) == 2 and stage("learn").image(ds) == "deepspeed"


def test_cli_and_config_take_their_stage_names_from_the_graph():
    args = build_parser().parse_args(["stage", "prepare", "--config", "demo", "--run-id", "r"])
    assert args.name == "prepare"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["stage", "nosuch", "--config", "demo", "--run-id", "r"])
    resources = cfg().pipeline.resources
    assert sorted(type(resources).model_fields) == sorted(STAGE_NAMES)
    assert (resources.learn.cpu, resources.learn.memory) == (stage("learn").cpu,
                                                              stage("learn").memory)
    # a partial entry keeps the stage's other defaults
    assert cfg(pipeline={"resources": {"learn": {"gpus": 1}}}).pipeline.resources.learn.memory \
        == stage("learn").memory


def _runtime_imports(path: Path, package: str) -> set[str]:
    """Project modules `path` imports when it runs (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                   for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n.startswith("shardrl.")}


def test_no_import_cycles_between_subpackages():
    edges: dict[str, set[str]] = {}
    for path in (SRC / "shardrl").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        package = ".".join(parts[:-1] if parts[-1] != "__init__" else parts[:-1])
        if parts[-1] == "__init__":
            parts = parts[:-1]
        top = ".".join(parts[:2])
        for dep in _runtime_imports(path, package):
            other = ".".join(dep.split(".")[:2])
            if other != top:
                edges.setdefault(top, set()).add(other)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt == goal:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False

    cycles = sorted({tuple(sorted((a, b))) for a, deps in edges.items() for b in deps
                     if reaches(b, a)})
    assert edges, "no imports found: the scan is broken"
    assert cycles == []
