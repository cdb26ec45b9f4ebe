"""Moving models through the store: full folders (v0, ref) and per-version weights.

`policy/v000000/` and `ref/` hold a complete Hugging Face folder (config, tokenizer,
safetensors weights). A later version v holds its weights in the publish dtype
(`learner.publish`): in full (`model.safetensors`) when v % full_every == 0, else as a delta
against v - 1 (`delta.safetensors`, see `shardrl.models.delta`). Every folder gets a
`MANIFEST.json` (sha256 per file; for a version also its kind, dtype and `full`, the full
snapshot its chain starts from) written last, and `policy/LATEST.json` is written after the
version it points to, so a reader never sees a half-published model.

A reader rebuilds version v from the full snapshot `full` and the deltas after it, every file
checked against its manifest; `PolicyWeights` keeps the state it read last and moves it
forward by the deltas alone when that reads fewer bytes than the full snapshot (the manifest
gives each file's size), from the full snapshot otherwise or when a delta it would need is
gone. Retention keeps every version a needed version's chain starts from.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from ..models.delta import DTYPES, apply_delta, cast_state, encode_delta
from ..models.io import (
    check_safe_weights_dir,
    load_causal_lm,
    load_state_dict_from_safetensors,
    load_tokenizer,
    write_safetensors,
)
from ..store import RunKeys, Store
from ..store.base import NotFound
from ..store.records import PolicyPointer

MANIFEST = "MANIFEST.json"
WEIGHTS = "model.safetensors"
DELTA = "delta.safetensors"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload_folder(store: Store, prefix: str, folder: Path) -> dict[str, str]:
    """Put every file of `folder` under `prefix`, then its manifest; returns the manifest."""
    check_safe_weights_dir(folder)
    manifest = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        data = path.read_bytes()
        store.put_bytes(prefix + rel, data)
        manifest[rel] = _sha(data)
    store.put_json(prefix + MANIFEST, {"files": manifest, "time": time.time()})
    return manifest


def download_folder(store: Store, prefix: str, dest: Path) -> Path:
    """Fetch a published folder into `dest`, checking every file against the manifest."""
    manifest = store.get_json(prefix + MANIFEST)["files"]
    dest.mkdir(parents=True, exist_ok=True)
    for rel, digest in manifest.items():
        target = dest / rel
        if target.exists() and _sha(target.read_bytes()) == digest:
            continue
        data = store.get_bytes(prefix + rel)
        if _sha(data) != digest:
            raise ValueError(f"{prefix}{rel}: sha256 does not match the manifest")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    check_safe_weights_dir(dest)
    return dest


def publish_dtype(cfg) -> torch.dtype:
    """The dtype policy versions are published in (`learner.publish.dtype`; auto: model.dtype)."""
    name = cfg.learner.publish.dtype
    return DTYPES[cfg.model.dtype if name == "auto" else name]


def full_base(version: int, full_every: int) -> int:
    """The full snapshot the chain of `version` starts from (published on that schedule)."""
    return version - version % full_every


def publish_weights(store: Store, keys: RunKeys, version: int, state: dict[str, torch.Tensor],
                    prev: dict[str, torch.Tensor] | None, full_every: int) -> int:
    """Publish `state` (`publish_state`, one dtype) as policy `version`: the delta from
    `prev` (the published state of `version - 1`), and when version % full_every == 0 the
    full weights too (a reader that follows the versions reads only deltas; one that starts
    late or lost its base reads the last full snapshot). Then the manifest; returns the
    bytes written."""
    dtypes = {str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()}
    start = full_base(version, full_every)
    digests, sizes = {}, {}
    if prev is not None:
        digests[DELTA], sizes[DELTA] = _put_tensors(store, keys.policy_file(version, DELTA),
                                                    encode_delta(prev, state),
                                                    {"base": str(version - 1)})
    elif start != version:
        raise ValueError(f"policy v{version} is a delta: it needs the state of v{version - 1}")
    if start == version:
        digests[WEIGHTS], sizes[WEIGHTS] = _put_tensors(
            store, keys.policy_file(version, WEIGHTS), state, {"format": "pt"})
    store.put_json(keys.policy_file(version, MANIFEST),
                   {"files": digests, "bytes": sizes, "base": 0,
                    "time": time.time(), "kind": "full" if start == version else "delta",
                    "full": start, "every": full_every, "dtype": ",".join(sorted(dtypes))})
    return sum(sizes.values())


def _put_tensors(store: Store, key: str, tensors: dict[str, torch.Tensor],
                 metadata: dict[str, str]) -> tuple[str, int]:
    """Write `tensors` at `key` as safetensors, streamed and hashed as written (no serialized
    copy in memory); (sha256, bytes)."""
    with store.writer(key) as out:
        hashed = _Hashed(out)
        written = write_safetensors(hashed, tensors, metadata=metadata)
    return hashed.sha.hexdigest(), written


class _Hashed:
    """A binary file that also feeds what is written to it into a sha256."""

    def __init__(self, out) -> None:
        self.out, self.sha = out, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.out.write(data)


def point_latest(store: Store, keys: RunKeys, version: int, step: int | None = None) -> None:
    """Move `policy/LATEST.json` to `version` (published by learner `step`, if any)."""
    PolicyPointer(version=version, time=time.time(), step=step).write(store, keys.latest_policy())


class ChainBroken(Exception):
    """A version a reader needs is gone from the store (collected after the reader looked)."""


def _manifest(store: Store, keys: RunKeys, version: int) -> dict:
    try:
        return store.get_json(keys.policy_file(version, MANIFEST))
    except NotFound as e:
        raise ChainBroken(f"policy v{version} is not in the store") from e


def _checked(store: Store, keys: RunKeys, version: int, name: str, digest: str) -> bytes:
    try:
        data = store.get_bytes(keys.policy_file(version, name))
    except NotFound as e:
        raise ChainBroken(f"policy v{version}/{name} is not in the store") from e
    if _sha(data) != digest:
        raise ValueError(f"policy v{version}: {name} does not match its manifest")
    return data


class PolicyWeights:
    """A reader's copy of one published version's weights, moved forward by deltas.

    From version u to v it applies the deltas of u + 1 .. v when u is inside v's chain (at
    or past the full snapshot f the chain starts from), is one version before f, or when the
    deltas of u + 1 .. f read fewer bytes than f's full weights (`follows`); else (or when
    one of those deltas is gone) it reads f's full snapshot and the deltas after it. A dense
    delta (float32, or a learning rate that moves every element) is as large as the full
    weights, so a reader two or more versions behind f reads f; a sparse one is followed
    further.
    """

    def __init__(self) -> None:
        self.version: int | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.read_bytes = 0
        """Weight bytes read from the store (full snapshots and deltas)."""

    def get(self, store: Store, keys: RunKeys, version: int) -> dict[str, torch.Tensor]:
        """The state of `version`; the returned tensors change with the next `get`."""
        if version == self.version:
            return self.state
        manifest = _manifest(store, keys, version)
        start = version if manifest.get("kind", "full") == "full" else int(manifest["full"])
        full = manifest if start == version else None  # the manifest of `start`, once read
        if self.version is not None and self.version < version:
            if start > self.version:
                full = full or _manifest(store, keys, start)
            if self.follows(start, full, version - self.version, manifest.get("every", 1)):
                try:
                    self._forward(store, keys, version)
                    return self.state
                except ChainBroken:  # a delta is gone: rebuild from the full snapshot
                    pass
        self._full(store, keys, start, manifest.get("dtype"), full)
        self._forward(store, keys, version)
        return self.state

    def follows(self, start: int, full: dict | None, ahead: int, every: int) -> bool:
        """Whether to reach a version `ahead` of this one through the deltas alone: its
        chain starts at the full snapshot `start` (manifest `full`, needed when `start` is
        past this version). Manifests without file sizes (published before they were
        recorded) are followed for up to one period (`every`) ahead."""
        if start <= self.version:  # inside the chain: the deltas are all a rebuild reads too
            return True
        sizes = full.get("bytes", {})
        if DELTA not in sizes or WEIGHTS not in sizes:
            return ahead <= every
        # the deltas up to `start`, each about the size of start's own, against its weights;
        # start's delta alone costs about what its weights do (a dense one: a longer header)
        deltas = start - self.version
        return deltas == 1 or deltas * sizes[DELTA] <= sizes[WEIGHTS]

    def _full(self, store: Store, keys: RunKeys, version: int, dtype: str | None,
              manifest: dict | None = None) -> None:
        files = (manifest or _manifest(store, keys, version))["files"]
        state: dict[str, torch.Tensor] = {}
        for name, digest in sorted(files.items()):
            if name.endswith(".safetensors") and name != DELTA:
                data = _checked(store, keys, version, name, digest)
                self.read_bytes += len(data)
                state.update(load_state_dict_from_safetensors(data))
        if dtype and version == 0 and "," not in dtype:  # the snapshot's own dtype may differ
            state = cast_state(state, DTYPES[dtype])
        self.state, self.version = {k: t.contiguous() for k, t in state.items()}, version

    def _forward(self, store: Store, keys: RunKeys, version: int) -> None:
        while self.version < version:
            v = self.version + 1
            files = _manifest(store, keys, v)["files"]
            if DELTA not in files:
                raise ChainBroken(f"policy v{v} has no delta")
            data = _checked(store, keys, v, DELTA, files[DELTA])
            self.read_bytes += len(data)
            apply_delta(self.state, load_state_dict_from_safetensors(data))
            self.version = v


def fetch_weights(store: Store, keys: RunKeys, version: int) -> dict[str, torch.Tensor]:
    """The state dict of policy `version` in its publish dtype (safetensors only), rebuilt
    from its full snapshot and deltas, every file checked against its manifest."""
    return PolicyWeights().get(store, keys, version)


def load_policy(store: Store, keys: RunKeys, version: int, cache: Path, dtype=torch.float32):
    """(model, tokenizer) of policy `version`, built from the v0 folder plus that version's weights."""
    base = download_folder(store, keys.policy_prefix(0), cache / "policy-base")
    model = load_causal_lm(base, dtype=dtype)
    if version != 0:
        model.load_state_dict(fetch_weights(store, keys, version), strict=False)
    return model, load_tokenizer(base)


class BasePolicy:
    """Policy v0's model and tokenizer for a stage that may start before the run exists.

    The snapshot uploads v0's folder (its manifest last), evaluates v0, and only then writes
    `policy/LATEST.json` and run.json. A stage the local runner started during the snapshot
    loads v0 as soon as its manifest is there (`preload`), while the snapshot evaluates it,
    instead of after run.json, where the load would delay the run's first shards and step.
    `take`, called once the run exists, hands that model over if v0's manifest is still the
    one it loaded (a snapshot restarted before writing run.json publishes v0 again, maybe
    with other bytes), and loads v0 otherwise. Each stage's copy of v0 is then in memory
    while the snapshot's process still holds its own (for the length of v0's evaluation);
    a cluster pipeline starts these stages after the snapshot, where nothing loads early."""

    def __init__(self, store: Store, keys: RunKeys, cache: Path) -> None:
        self.store, self.keys, self.cache = store, keys, cache
        self.manifest: dict[str, str] | None = None
        """v0's manifest as read before the early load (None: nothing loaded early)."""
        self.loaded: tuple | None = None

    def ready(self) -> bool:
        """Whether v0 can be loaded now: its folder is complete (or the run exists)."""
        return (self.store.exists(self.keys.policy_prefix(0) + MANIFEST)
                or self.store.exists(self.keys.run_json()))

    def preload(self) -> None:
        """Load v0 now, unless the run already exists (then `take` loads it as before).
        Call once `ready`."""
        if self.store.exists(self.keys.run_json()):
            return
        try:
            self.manifest = self._manifest()
            self.loaded = load_policy(self.store, self.keys, 0, self.cache)
        except Exception:  # noqa: BLE001 - v0 uploaded again meanwhile (a file no longer
            # matches the manifest read), or anything else: `take` loads v0 once the run
            # exists, and raises then if the error persists
            self.manifest = self.loaded = None

    def take(self):
        """(model, tokenizer) of v0, once the run exists."""
        loaded, self.loaded = self.loaded, None
        if loaded is not None and self._manifest() == self.manifest:
            return loaded
        del loaded  # not two models at once
        return load_policy(self.store, self.keys, 0, self.cache)

    def _manifest(self) -> dict[str, str]:
        return self.store.get_json(self.keys.policy_prefix(0) + MANIFEST)["files"]


def load_reference(store: Store, keys: RunKeys, cache: Path, dtype=torch.float32):
    """(model, tokenizer) of the frozen reference."""
    folder = download_folder(store, keys.ref_prefix(), cache / "ref")
    return load_causal_lm(folder, dtype=dtype), load_tokenizer(folder)
