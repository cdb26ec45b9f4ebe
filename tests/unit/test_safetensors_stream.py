"""Safetensors written tensor by tensor (`write_safetensors`) read back as
`safetensors.torch` reads what it saves; checkpoints streamed from live tensors."""

from __future__ import annotations

import io
import threading

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from shardrl.learner_backends.base import Loan
from shardrl.models import io as model_io
from shardrl.models.io import safetensors_size, write_safetensors
from shardrl.stages.checkpoint import CheckpointFiles, latest_checkpoint, release, save_checkpoint
from shardrl.store import LocalStore, RunKeys


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 5, generator=g)
    return {
        "f32": torch.randn(3, 4, generator=g),
        "bf16": torch.randn(7, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, generator=g).to(torch.float16),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "i64": torch.arange(5, dtype=torch.int64) - 2,
        "i32": torch.tensor([[1, -2], [3, 4]], dtype=torch.int32),
        "i16": torch.tensor([-7, 7], dtype=torch.int16),
        "i8": torch.tensor([-1, 0, 1], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "scalar_bf16": torch.tensor(-1.25, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
        "empty_bf16": torch.zeros(3, 0, dtype=torch.bfloat16),
        "transposed": wide.t(),  # not contiguous: written as its values in row-major order
        "slice": wide[1:4, ::2],
        "a.name/with.dots": torch.ones(1, 1, 1),
    }


def _written(tensors, metadata=None) -> bytes:
    out = io.BytesIO()
    n = write_safetensors(out, tensors, metadata)
    data = out.getvalue()
    assert n == len(data) == safetensors_size(tensors, metadata)
    return data


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_round_trip_through_safetensors_load():
    tensors = _tensors()
    data = _written(tensors, {"format": "pt", "step": "12"})
    _same(st_load(data), tensors)
    header_len = int.from_bytes(data[:8], "little")
    assert header_len % 8 == 0  # the data starts 8-byte aligned


def test_read_with_safe_open_and_metadata(tmp_path):
    tensors = _tensors()
    path = tmp_path / "x.safetensors"
    path.write_bytes(_written(tensors, {"format": "pt", "note": "é"}))
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "note": "é"}
        _same({k: f.get_tensor(k) for k in f.keys()}, tensors)  # noqa: SIM118


def test_bytes_equal_safetensors_save_for_one_dtype_per_width():
    # safetensors orders by dtype, then name; with one dtype per width the layouts agree
    g = torch.Generator().manual_seed(1)
    tensors = {"b": torch.randn(3, 2, generator=g), "a": torch.randn(5, generator=g),
               "s": torch.tensor(1.0), "e": torch.zeros(0),
               "h": torch.randn(4, generator=g).to(torch.bfloat16),
               "c": torch.arange(3, dtype=torch.int64)}
    assert _written(tensors, {"format": "pt"}) == st_save(tensors, metadata={"format": "pt"})
    assert _written(tensors) == st_save(tensors)


def test_no_tensors_and_large_tensors_in_slices(monkeypatch):
    assert st_load(_written({})) == {}
    monkeypatch.setattr(model_io, "WRITE_CHUNK", 7)  # slices that cut through elements
    tensors = {"x": torch.randn(33), "y": torch.randn(5).to(torch.bfloat16)}
    _same(st_load(_written(tensors)), tensors)


def test_unsupported_dtype_is_refused():
    with pytest.raises(ValueError, match="complex64"):
        _written({"z": torch.zeros(2, dtype=torch.complex64)})


def test_checkpoint_files_are_streamed_and_the_loan_returned(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    state = {"policy/w/exp_avg": torch.randn(4, 3), "step": torch.tensor(3.0)}
    masters = {"w": torch.randn(4, 3), "b": torch.zeros(0)}
    expected = {"backend": {k: t.clone() for k, t in state.items()},
                "policy": {k: t.clone() for k, t in masters.items()}}
    files = CheckpointFiles(backend=state, policy=masters)
    files.loan = Loan()
    save_checkpoint(store, keys, 4, files)
    assert files.loan.is_done and not files
    assert latest_checkpoint(store, keys) == 4
    for name, tensors in expected.items():
        _same(st_load(store.get_bytes(keys.learner_file(4, f"{name}.safetensors"))), tensors)


def test_a_failed_checkpoint_writes_nothing_and_returns_the_loan(tmp_path):
    store, keys = LocalStore(tmp_path), RunKeys("r1")
    files = CheckpointFiles(backend={"ok": torch.ones(2)},
                            policy={"bad": torch.zeros(1, dtype=torch.complex64)})
    files.loan = Loan()
    with pytest.raises(ValueError):
        save_checkpoint(store, keys, 4, files)
    assert files.loan.is_done
    assert latest_checkpoint(store, keys) is None
    assert store.list(keys.root) == []  # no file committed, no temp file left
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_torch_backend_updates_wait_for_the_loans():
    from shardrl.learner_backends.base import OptimSettings
    from shardrl.learner_backends.torch_backend import TorchLearnerBackend

    lm = torch.nn.Linear(3, 2)
    lm.config = None
    backend = TorchLearnerBackend(lm, OptimSettings(lr=0.1, betas=(0.9, 0.99), weight_decay=0.0,
                                                    grad_clip=None))
    x = torch.randn(4, 3)
    assert backend.step(lm(x).square().sum())[0]
    live = backend.state_dict(copy=False)
    copied = backend.state_dict()
    key = next(k for k in live if k.endswith("exp_avg"))
    moment = next(iter(backend.opt.state.values()))["exp_avg"]
    assert live[key].data_ptr() == moment.data_ptr()
    assert copied[key].data_ptr() != moment.data_ptr()
    before = live[key].clone()
    loan = backend.lend()
    stepped = threading.Event()

    def step() -> None:
        backend.step(lm(x).square().sum())
        stepped.set()

    thread = threading.Thread(target=step)
    thread.start()
    assert not stepped.wait(0.5)  # the backward pass ran; the update waits for the loan
    assert torch.equal(live[key], before)
    loan.done()
    thread.join(30)
    assert stepped.is_set() and not torch.equal(live[key], before)


@pytest.mark.parametrize("where", ["thread", "process"])
def test_a_commit_that_fails_before_its_checkpoint_returns_the_loan(tmp_path, where):
    from shardrl.stages.learn.commit import Commit
    from shardrl.stages.learn.offload import commit_writes
    from shardrl.store.records import Progress

    store, keys = LocalStore(tmp_path), RunKeys("r1")
    files = CheckpointFiles(backend={"step": torch.tensor(1.0)})
    files.loan = Loan()
    # version 3 of a full-every-10 schedule is a delta: a writer without the state of
    # version 2 fails it
    # (in the child process too, whose error comes back as the same exception)
    commit = Commit(progress=Progress(version=3, commits=3), delta=[], stepped=True,
                    weights={"w": torch.zeros(2)}, full_every=10,
                    checkpoint=files)
    out = commit_writes(store, keys, where)
    try:
        with pytest.raises(ValueError, match="is a delta"):
            commit.write(out, store, keys, 2, lambda version: None)
    finally:
        out.close()
    assert files.loan.is_done
    assert latest_checkpoint(store, keys) is None



@pytest.mark.parametrize("lend", [False, True])
def test_gather_lends_the_published_weights_only_when_asked(lend):
    from shardrl.learner_backends.base import OptimSettings
    from shardrl.learner_backends.torch_backend import TorchLearnerBackend
    from shardrl.stages.learn import ranks

    lm = torch.nn.Linear(3, 2)
    lm.config = None
    backend = TorchLearnerBackend(lm, OptimSettings(lr=0.1, betas=(0.9, 0.99), weight_decay=0.0,
                                                    grad_clip=None))
    x = torch.randn(4, 3)
    weights, files = ranks.gather(backend, lm, leader=True, checkpoint_due=False,
                                  dtype=torch.float32, lend_weights=lend)
    assert not files  # no checkpoint due
    assert torch.equal(weights["weight"], lm.weight.detach())
    assert (weights["weight"].data_ptr() == lm.weight.data_ptr()) == lend
    assert (files.loan is not None) == lend
    before = weights["weight"].clone()
    stepped = threading.Event()

    def step() -> None:
        backend.step(lm(x).square().sum())
        stepped.set()

    thread = threading.Thread(target=step, daemon=True)
    thread.start()
    try:
        if lend:  # the lent weights stay as published until the writer is done with them
            assert not stepped.wait(0.5)
            assert torch.equal(weights["weight"], before)
    finally:
        release(files)
    thread.join(30)
    assert stepped.is_set()
    # lent: the model's own tensor, changed by the step; copied: the published values kept
    assert torch.equal(weights["weight"], before) != lend
    # published in a narrower dtype the weights are a cast, a copy: nothing to lend
    narrow, files = ranks.gather(backend, lm, leader=True, checkpoint_due=False,
                                 dtype=torch.bfloat16, lend_weights=lend)
    assert files.loan is None  # so the next update does not wait for the writer
    assert narrow["weight"].dtype == torch.bfloat16
    assert narrow["weight"].data_ptr() != lm.weight.data_ptr()


def test_a_stored_file_reads_back_tensor_by_tensor_reading_only_what_is_asked():
    from shardrl.models.io import StoredSafetensors

    tensors = {k: v.contiguous() for k, v in _tensors().items()}
    data = st_save(tensors, metadata={"step": "3"})
    reads: list[tuple[int, int]] = []

    def read(offset: int, length: int) -> bytes:
        assert offset >= 0 and length >= 1
        reads.append((offset, length))
        return data[offset:offset + length]

    stored = StoredSafetensors(read, "ckpt")
    assert sum(n for _, n in reads) == len(data) - sum(t.numel() * t.element_size() for t in tensors.values())
    assert stored.metadata == {"step": "3"}
    assert set(stored) == set(tensors) and len(stored) == len(tensors)
    assert "f32" in stored and "nope" not in stored and stored.get("nope") is None
    reads.clear()
    bf16 = stored["bf16"]
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, tensors["bf16"])
    assert reads == [(reads[0][0], 7 * 2)]  # its own 14 bytes, nothing else
    for name, expected in tensors.items():
        got = stored[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got, expected), name


@pytest.mark.parametrize("cut", ["empty", "length", "header", "tensor", "not_json"])
def test_a_stored_file_that_is_not_safetensors_or_is_cut_short_says_so(cut):
    from shardrl.models.io import StoredSafetensors

    data = st_save({"a": torch.ones(4), "b": torch.zeros(2)})
    data = {"empty": b"", "length": data[:5], "header": data[:20], "tensor": data[:-3],
            "not_json": b"\x04\0\0\0\0\0\0\0[1] "}[cut]
    with pytest.raises(ValueError, match="ckpt"):
        stored = StoredSafetensors(lambda o, n: data[o:o + n], "ckpt")
        for name in stored:
            stored[name]
