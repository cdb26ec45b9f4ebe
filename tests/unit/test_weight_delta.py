"""Published weights as deltas: hand-checked encodings, bit-exact chains through the store,
and readers that start late or whose base version was collected."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from shardrl.models.delta import (
    FULL,
    INDEX,
    VALUE,
    apply_delta,
    encode_delta,
    publish_state,
    state_bytes,
    states_equal,
)
from shardrl.stages.policy import (
    DELTA,
    MANIFEST,
    WEIGHTS,
    ChainBroken,
    PolicyWeights,
    fetch_weights,
    publish_weights,
    upload_folder,
)
from shardrl.store import LocalStore, RunKeys


def test_a_delta_holds_changed_elements_or_whole_tensors_and_skips_the_rest():
    prev = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.zeros(2, 2),
            "c": torch.tensor([0.0, float("nan")]), "d": torch.ones(3)}
    cur = {"a": torch.tensor([1.0, 2.0, 5.0, 4.0]),  # one of four changed: sparse
           "b": torch.tensor([[1.0, 2.0], [0.0, 3.0]]),  # three of four: whole tensor
           "c": torch.tensor([-0.0, float("nan")]),  # -0.0 differs in its bits
           "d": torch.ones(3), "e": torch.ones(1)}  # unchanged; new name
    delta = encode_delta(prev, cur)
    # a: 1 * (4 index + 4 value) = 8 bytes < 16; c: 8 bytes = 8 bytes whole -> whole
    assert set(delta) == {INDEX + "a", VALUE + "a", FULL + "b", FULL + "c", FULL + "e"}
    assert delta[INDEX + "a"].tolist() == [2] and delta[INDEX + "a"].dtype == torch.int32
    assert delta[VALUE + "a"].tolist() == [5.0]
    state = {k: t.clone() for k, t in prev.items()}
    apply_delta(state, delta)
    assert states_equal(state, cur)
    assert torch.signbit(state["c"][0])


def test_bf16_deltas_are_sparse_and_rebuild_the_publisher_bits():
    torch.manual_seed(0)
    masters = {"w": torch.randn(64, 64), "v": torch.randn(1000)}
    prev = {k: t.bfloat16() for k, t in masters.items()}
    for t in masters.values():  # an AdamW-sized step: most bf16 values do not move
        t.add_(1e-4 * torch.randn_like(t).sign())
    cur = {k: t.bfloat16() for k, t in masters.items()}
    delta = encode_delta(prev, cur)
    state = {k: t.clone() for k, t in prev.items()}
    apply_delta(state, delta)
    assert states_equal(state, cur)
    changed = sum(int((prev[k].view(torch.int16) != cur[k].view(torch.int16)).sum())
                  for k in cur)
    assert 0 < changed < state_bytes(cur) // 2 // 10  # under a tenth of the elements moved
    assert state_bytes(delta) == changed * (4 + 2)  # sparse: an int32 index and a bf16 value


def test_publish_state_casts_copies_and_stores_tied_weights_once():
    emb = torch.nn.Embedding(5, 3)
    model = torch.nn.ModuleDict({"emb": emb, "head": torch.nn.Linear(3, 5, bias=False)})
    model["head"].weight = emb.weight  # tied
    model.register_buffer("steps", torch.tensor([7]))
    state = publish_state(model, torch.bfloat16)
    assert set(state) == {"emb.weight", "steps"}
    assert state["emb.weight"].dtype == torch.bfloat16 and state["steps"].dtype == torch.int64
    assert torch.equal(state["emb.weight"], emb.weight.detach().bfloat16())
    with torch.no_grad():
        emb.weight.add_(1.0)  # a copy: later updates do not reach the published state
    assert not torch.equal(state["emb.weight"], emb.weight.detach().bfloat16())


def _publish_run(tmp_path, versions: int, full_every: int, dtype=torch.bfloat16,
                 sparse: bool = False):
    """A store with v0 as a float32 folder and `versions` published versions; the states the
    publisher published, by version. Each version moves every element (dense deltas), or with
    `sparse` only the first of `b`."""
    store, keys = LocalStore(tmp_path / "store"), RunKeys("r")
    torch.manual_seed(1)
    masters = {"w": torch.randn(32, 32), "b": torch.randn(32)}
    folder = tmp_path / "v0"
    folder.mkdir()
    save_file(masters, str(folder / WEIGHTS))
    upload_folder(store, keys.policy_prefix(0), folder)
    published = {0: {k: t.to(dtype) for k, t in masters.items()}}
    for v in range(1, versions + 1):
        if sparse:
            masters["b"][0] += 0.25
        else:
            for t in masters.values():
                t.add_(3e-3 * torch.randn_like(t))
        state = {k: t.to(dtype) for k, t in masters.items()}
        publish_weights(store, keys, v, state, published[v - 1], full_every)
        published[v] = state
    return store, keys, published


def test_every_version_rebuilds_exactly_from_its_full_snapshot_and_deltas(tmp_path):
    store, keys, published = _publish_run(tmp_path, versions=7, full_every=3)
    kinds = {v: store.get_json(keys.policy_file(v, MANIFEST))["kind"] for v in range(1, 8)}
    assert kinds == {1: "delta", 2: "delta", 3: "full", 4: "delta", 5: "delta", 6: "full",
                     7: "delta"}
    assert store.get_json(keys.policy_file(5, MANIFEST))["full"] == 3
    assert store.exists(keys.policy_file(3, WEIGHTS)) and store.exists(keys.policy_file(4, DELTA))
    for v in range(1, 8):  # a fresh reader of each version (v1, v2 start from the fp32 v0)
        assert states_equal(fetch_weights(store, keys, v), published[v]), v
    # full versions hold their delta too: a reader following the versions reads only deltas
    reader = PolicyWeights()
    for v in range(1, 8):
        assert states_equal(reader.get(store, keys, v), published[v]), v
    deltas = sum(len(store.get_bytes(keys.policy_file(v, DELTA))) for v in range(1, 8))
    assert reader.read_bytes == len(store.get_bytes(keys.policy_file(0, WEIGHTS))) + deltas
    size = lambda v, name: len(store.get_bytes(keys.policy_file(v, name)))  # noqa: E731
    assert store.get_json(keys.policy_file(3, MANIFEST))["bytes"] == {
        DELTA: size(3, DELTA), WEIGHTS: size(3, WEIGHTS)}
    # these deltas are dense, as large as the weights: one version before the full snapshot
    # v3 a reader follows by deltas, two before it reads v3's weights instead of two deltas
    near = PolicyWeights()
    near.get(store, keys, 2)
    before = near.read_bytes
    near.get(store, keys, 4)
    assert near.read_bytes - before == size(3, DELTA) + size(4, DELTA)
    behind = PolicyWeights()
    behind.get(store, keys, 1)
    before = behind.read_bytes
    assert states_equal(behind.get(store, keys, 4), published[4])
    assert behind.read_bytes - before == size(3, WEIGHTS) + size(4, DELTA)
    far = PolicyWeights()
    far.get(store, keys, 1)
    before = far.read_bytes
    assert states_equal(far.get(store, keys, 7), published[7])
    assert far.read_bytes - before == (len(store.get_bytes(keys.policy_file(6, WEIGHTS)))
                                       + len(store.get_bytes(keys.policy_file(7, DELTA))))


def test_a_reader_follows_sparse_deltas_past_full_snapshots_and_old_manifests_by_period(
        tmp_path):
    store, keys, published = _publish_run(tmp_path, versions=7, full_every=3, sparse=True)
    size = lambda v, name: len(store.get_bytes(keys.policy_file(v, name)))  # noqa: E731
    assert 5 * size(6, DELTA) < size(6, WEIGHTS)  # one element moved per version
    reader = PolicyWeights()
    reader.get(store, keys, 1)
    before = reader.read_bytes
    assert states_equal(reader.get(store, keys, 7), published[7])  # v2..v7, past v3 and v6
    assert reader.read_bytes - before == sum(size(v, DELTA) for v in range(2, 8))
    # a manifest written before file sizes were recorded: followed up to one period ahead
    for v in (3, 6):
        key = keys.policy_file(v, MANIFEST)
        manifest = store.get_json(key)
        del manifest["bytes"]
        store.put_json(key, manifest)
    within = PolicyWeights()
    within.get(store, keys, 1)
    before = within.read_bytes
    within.get(store, keys, 4)  # 3 ahead: one period
    assert within.read_bytes - before == sum(size(v, DELTA) for v in (2, 3, 4))
    beyond = PolicyWeights()
    beyond.get(store, keys, 2)
    before = beyond.read_bytes
    assert states_equal(beyond.get(store, keys, 7), published[7])  # 5 ahead: from v6
    assert beyond.read_bytes - before == size(6, WEIGHTS) + size(7, DELTA)


def test_a_late_reader_or_one_whose_base_was_collected_gets_a_consistent_policy(tmp_path):
    store, keys, published = _publish_run(tmp_path, versions=8, full_every=3)
    reader = PolicyWeights()
    reader.get(store, keys, 2)
    for v in (1, 2, 3, 4, 5):  # retention collected everything before the chain of 8
        for key in store.list(keys.policy_prefix(v)):
            store.delete(key)
    assert states_equal(reader.get(store, keys, 8), published[8])  # from the full v6
    assert reader.version == 8
    late = PolicyWeights()
    assert states_equal(late.get(store, keys, 7), published[7])
    # a chain with a hole cannot be rebuilt: the reader says so instead of mixing versions
    store.delete(keys.policy_file(7, DELTA))
    with pytest.raises(ChainBroken):
        PolicyWeights().get(store, keys, 8)


def test_a_tampered_delta_is_refused(tmp_path):
    store, keys, _ = _publish_run(tmp_path, versions=2, full_every=10)
    store.put_bytes(keys.policy_file(2, DELTA), b"x" * 20)
    with pytest.raises(ValueError, match="manifest"):
        fetch_weights(store, keys, 2)


def test_a_full_snapshot_is_streamed_and_its_manifest_digest_is_of_the_stored_bytes(tmp_path):
    import hashlib

    store, keys = LocalStore(str(tmp_path)), RunKeys("r1")
    prev = {"w": torch.zeros(3, 4, dtype=torch.bfloat16), "b": torch.ones(4)}
    state = {"w": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(4)}
    written = publish_weights(store, keys, 2, state, prev, full_every=2)
    full = store.get_bytes(keys.policy_file(2, WEIGHTS))
    delta = store.get_bytes(keys.policy_file(2, DELTA))
    assert written == len(full) + len(delta)
    files = store.get_json(keys.policy_file(2, MANIFEST))["files"]
    assert files == {WEIGHTS: hashlib.sha256(full).hexdigest(),
                     DELTA: hashlib.sha256(delta).hexdigest()}
    assert states_equal(fetch_weights(store, keys, 2), state)
