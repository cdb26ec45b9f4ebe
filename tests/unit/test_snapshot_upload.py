"""The snapshot stage sends its folders from the disk, as `policy.upload_folder` lays them out."""

from __future__ import annotations

import torch
from safetensors.torch import save as st_save

from shardrl.store import LocalStore


def test_the_snapshot_uploads_a_folder_as_upload_folder_does(tmp_path):
    from shardrl.stages.policy import MANIFEST, download_folder, upload_folder
    from shardrl.stages.snapshot import _upload

    folder = tmp_path / "model"
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(st_save({"w": torch.randn(300, 7)}))
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "tok.txt").write_text("x" * 5000)
    store = LocalStore(tmp_path / "store")
    expected = upload_folder(store, "a/", folder)
    assert _upload(store, "b/", folder) == expected
    for rel in expected:
        assert store.get_bytes("b/" + rel) == store.get_bytes("a/" + rel)
    assert store.get_json("b/" + MANIFEST)["files"] == expected
    download_folder(store, "b/", tmp_path / "back")  # checked against the manifest
