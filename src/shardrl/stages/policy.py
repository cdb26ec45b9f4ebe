"""Moving models through the store: full folders (v0, ref) and per-version weights.

`policy/v000000/` and `ref/` hold a complete Hugging Face folder (config, tokenizer,
safetensors weights); later versions hold only `model.safetensors`. Every folder gets a
`MANIFEST.json` (sha256 per file) written last, and `policy/LATEST.json` is written after the
version it points to, so a reader never sees a half-published model.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch

from ..models.io import (
    check_safe_weights_dir,
    load_causal_lm,
    load_state_dict_from_safetensors,
    load_tokenizer,
)
from ..store import RunKeys, Store
from ..store.records import PolicyPointer

MANIFEST = "MANIFEST.json"
WEIGHTS = "model.safetensors"


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


def publish_weight_bytes(store: Store, keys: RunKeys, version: int, data: bytes) -> None:
    """Publish safetensors bytes (`state_dict_bytes`) as policy `version`, with its manifest."""
    store.put_bytes(keys.policy_file(version, WEIGHTS), data)
    store.put_json(keys.policy_file(version, MANIFEST),
                   {"files": {WEIGHTS: _sha(data)}, "base": 0, "time": time.time()})


def point_latest(store: Store, keys: RunKeys, version: int, step: int | None = None) -> None:
    """Move `policy/LATEST.json` to `version` (published by learner `step`, if any)."""
    PolicyPointer(version=version, time=time.time(), step=step).write(store, keys.latest_policy())


def fetch_weights(store: Store, keys: RunKeys, version: int) -> dict[str, torch.Tensor]:
    """The state dict of policy `version` (safetensors only), checked against its manifest."""
    manifest = store.get_json(keys.policy_file(version, MANIFEST))["files"]
    data = store.get_bytes(keys.policy_file(version, WEIGHTS))
    if _sha(data) != manifest[WEIGHTS]:
        raise ValueError(f"policy v{version}: weights do not match their manifest")
    return load_state_dict_from_safetensors(data)


def load_policy(store: Store, keys: RunKeys, version: int, cache: Path, dtype=torch.float32):
    """(model, tokenizer) of policy `version`, built from the v0 folder plus that version's weights."""
    base = download_folder(store, keys.policy_prefix(0), cache / "policy-base")
    model = load_causal_lm(base, dtype=dtype)
    if version != 0:
        model.load_state_dict(fetch_weights(store, keys, version), strict=False)
    return model, load_tokenizer(base)


def load_reference(store: Store, keys: RunKeys, cache: Path, dtype=torch.float32):
    """(model, tokenizer) of the frozen reference."""
    folder = download_folder(store, keys.ref_prefix(), cache / "ref")
    return load_causal_lm(folder, dtype=dtype), load_tokenizer(folder)
