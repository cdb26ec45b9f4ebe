"""Model and tokenizer I/O: safetensors only, manifests of sha256, tokenizer compatibility.

Pickle checkpoints can run arbitrary code when loaded, so a directory that holds any
(`*.bin`, `*.pt`, `*.pth`, `*.pkl`, `*.ckpt`) is refused before transformers looks at it,
and every load passes `use_safetensors=True`. A manifest maps each file of a saved
directory (relative POSIX name) to its sha256, so a reader can check that what it loads is
exactly what the writer published.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
WEIGHT_SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)


class UnsafeWeightsError(RuntimeError):
    """A model directory holds pickle weights or no safetensors weights at all."""


class ManifestMismatch(RuntimeError):
    """A directory's files differ from the manifest it was published with."""


class TokenizerMismatch(ValueError):
    """Two tokenizers that must be identical (policy and reference) are not."""


def check_safe_weights_dir(model_dir: str | Path) -> list[Path]:
    """The `*.safetensors` files of `model_dir` (searched recursively), sorted.

    Raises `UnsafeWeightsError` naming the first pickle file found, or saying that no
    safetensors file exists.
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {root} does not exist (relative paths start "
                                f"in the working folder; `make models` builds the SmolLM2 folder "
                                f"that the smollm2 preset names)")
    files = sorted(p for p in root.rglob("*") if p.is_file())
    for path in files:
        if path.name.endswith(PICKLE_SUFFIXES):
            raise UnsafeWeightsError(
                f"refusing {root}: it holds pickle weights {path.relative_to(root)} "
                "(pickle can execute code when loaded); convert the checkpoint to safetensors "
                "(`model.save_pretrained(dir)` with a recent transformers writes safetensors) "
                "and remove the pickle files"
            )
    weights = [p for p in files if p.name.endswith(".safetensors")]
    if not weights:
        raise UnsafeWeightsError(f"refusing {root}: it holds no *.safetensors weights")
    return weights


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def directory_manifest(root: str | Path) -> dict[str, str]:
    """{relative POSIX file name: sha256} for every regular file under `root`."""
    base = Path(root)
    return {
        p.relative_to(base).as_posix(): file_sha256(p)
        for p in sorted(base.rglob("*"))
        if p.is_file()
    }


def save_model(
    model: PreTrainedModel, tokenizer: Any | None, out_dir: str | Path
) -> dict[str, str]:
    """Save `model` (safetensors) and `tokenizer` into `out_dir`; return its manifest.

    The manifest covers every file in `out_dir` afterwards, so `out_dir` should be fresh.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # transformers >= 5 always writes safetensors and no longer takes the flag.
    params = inspect.signature(model.save_pretrained).parameters
    kwargs = {"safe_serialization": True} if "safe_serialization" in params else {}
    model.save_pretrained(str(out), **kwargs)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    check_safe_weights_dir(out)
    return directory_manifest(out)


def verify_manifest(model_dir: str | Path, manifest: Mapping[str, str]) -> None:
    """Raise `ManifestMismatch` unless every manifest file exists with its sha256.

    Extra files are tolerated (e.g. metadata written beside the model) unless they are
    weights (`*.safetensors` or pickle), which a loader would pick up.
    """
    root = Path(model_dir)
    problems: list[str] = []
    for name, expected in sorted(manifest.items()):
        path = root / name
        if not path.is_file():
            problems.append(f"missing {name}")
        elif (actual := file_sha256(path)) != expected:
            problems.append(f"{name}: sha256 {actual[:12]}… != manifest {expected[:12]}…")
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_file() and name not in manifest and path.name.endswith(WEIGHT_SUFFIXES):
            problems.append(f"unexpected weights file {name}")
    if problems:
        raise ManifestMismatch(f"{root} does not match its manifest: " + "; ".join(problems))


SYNC_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"
"""transformers loads weights on a pool of threads it does not wait for when it shuts it down
(`wait=False`): they can still be alive when `from_pretrained` returns. The local runner and
the learner fork after loading a model, and a process that forks should hold no threads, so
ShardRL loads on the calling thread (unless this variable is set in the environment)."""


@contextmanager
def loading_on_this_thread() -> Iterator[None]:
    """`from_pretrained` calls inside load their weights on the calling thread."""
    preset = SYNC_LOAD in os.environ
    if not preset:
        os.environ[SYNC_LOAD] = "1"
    try:
        yield
    finally:
        if not preset:
            os.environ.pop(SYNC_LOAD, None)


def load_causal_lm(model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """Load a causal LM from a local safetensors-only directory, in eval mode, on this thread."""
    check_safe_weights_dir(model_dir)
    with loading_on_this_thread():
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), use_safetensors=True, dtype=dtype, local_files_only=True
        )
    return model.eval()


def load_tokenizer(model_dir: str | Path) -> Any:
    """Load the tokenizer saved in `model_dir` (no network).

    A tokenizer without a pad token pads with its EOS token (as many chat models ship):
    padding positions are always masked by length, never found by comparing with the pad id.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def tokenizer_fingerprint(tokenizer: Any) -> dict[str, Any]:
    """What must agree between two tokenizers for their token ids to mean the same thing."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256("\n".join(f"{i}\t{t}" for t, i in vocab).encode()).hexdigest()
    return {
        "vocab_size": len(tokenizer),
        "vocab_sha256": digest,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "unk_token_id": tokenizer.unk_token_id,
        "padding_side": tokenizer.padding_side,
    }


def check_tokenizers_match(
    tok_a: Any, tok_b: Any, names: tuple[str, str] = ("policy", "reference")
) -> None:
    """Raise `TokenizerMismatch` listing every difference between two tokenizers."""
    fa, fb = tokenizer_fingerprint(tok_a), tokenizer_fingerprint(tok_b)
    diffs = [
        f"{key}: {names[0]}={fa[key]!r} {names[1]}={fb[key]!r}" for key in fa if fa[key] != fb[key]
    ]
    if diffs:
        raise TokenizerMismatch(
            f"the {names[0]} and {names[1]} tokenizers differ, so their token ids and "
            "logprobs are not comparable:\n  - " + "\n  - ".join(diffs) + "\nUse the "
            f"{names[0]}'s own tokenizer for the {names[1]} model, or re-snapshot both "
            "from the same base model."
        )


def state_dict_bytes(model: torch.nn.Module, metadata: Mapping[str, str] | None = None) -> bytes:
    """The model's state dict serialised as safetensors bytes (CPU copies).

    Tensors that share storage (tied embeddings) are written as separate copies, since
    safetensors refuses aliased tensors; `model.load_state_dict` then assigns both keys.
    """
    seen: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        storage = tensor.untyped_storage().data_ptr()
        t = tensor.detach().to("cpu").contiguous()
        tensors[key] = t.clone() if storage in seen else t
        seen.add(storage)
    return safetensors_save(tensors, metadata=dict(metadata) if metadata else None)


def load_state_dict_from_safetensors(data: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `state_dict_bytes`: {key: CPU tensor}."""
    return safetensors_load(data)


MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read (the format's limit)."""


class StoredSafetensors(Mapping[str, torch.Tensor]):
    """The tensors of a safetensors file, each read when asked for through `read(offset,
    length)` (a store's range read, which returns fewer bytes only at the file's end): a
    checkpoint loads one tensor at a time instead of whole, twice (its bytes and its
    tensors), in every process that loads it. Each tensor is decoded by safetensors itself,
    from a one-tensor file made of its header entry and its bytes. ValueError for a file
    that is not safetensors or is cut short; `name` says which in the message."""

    def __init__(self, read: Callable[[int, int], bytes], name: str = "safetensors file") -> None:
        self._read, self.name = read, name
        first = read(0, 8)
        if len(first) < 8:
            raise ValueError(f"{name}: not a safetensors file ({len(first)} bytes)")
        (size,) = struct.unpack("<Q", first)
        if not 0 < size <= MAX_HEADER_BYTES:
            raise ValueError(f"{name}: not a safetensors file (a header of {size} bytes)")
        text = read(8, size)
        try:
            header = json.loads(text) if len(text) == size else None
        except (UnicodeDecodeError, json.JSONDecodeError):
            header = None
        if not isinstance(header, dict):
            raise ValueError(f"{name}: not a safetensors file (its header is cut short or "
                             f"is not a JSON object)")
        self.metadata = header.pop("__metadata__", None)
        self._entries: dict[str, Any] = header
        self._start = 8 + size

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            one = {name: {"dtype": entry["dtype"], "shape": entry["shape"],
                          "data_offsets": [0, end - begin]}}
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{self.name}: tensor {name!r} has a malformed entry") from e
        if not 0 <= begin <= end:
            raise ValueError(f"{self.name}: tensor {name!r} has offsets {begin}..{end}")
        data = self._read(self._start + begin, end - begin) if end > begin else b""
        if len(data) != end - begin:
            raise ValueError(f"{self.name}: cut short in tensor {name!r}")
        text = json.dumps(one, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        text += b" " * (-len(text) % 8)
        try:
            return safetensors_load(struct.pack("<Q", len(text)) + text + data)[name]
        except (SafetensorError, KeyError, AssertionError, ValueError, TypeError) as e:
            # a dtype it does not know (or torch lacks), a shape its bytes do not fill
            raise ValueError(f"{self.name}: tensor {name!r} does not decode: {e}") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}
"""The safetensors name of each dtype `write_safetensors` writes."""

WRITE_CHUNK = 64 << 20
"""Bytes handed to one `write` call: a large tensor goes out in slices of its own memory."""


def safetensors_header(tensors: Mapping[str, torch.Tensor],
                       metadata: Mapping[str, str] | None = None) -> tuple[bytes, list[str]]:
    """The safetensors header of `tensors` (its 8-byte length included) and the order their
    data follows it in: widest dtype first, then by name, as `safetensors.torch.save` lays
    them out, so every tensor starts at a multiple of its element size."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name!r}: safetensors writing of {t.dtype} is not supported")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text, order


def safetensors_size(tensors: Mapping[str, torch.Tensor],
                     metadata: Mapping[str, str] | None = None) -> int:
    """The bytes `write_safetensors` writes for `tensors`."""
    header, _ = safetensors_header(tensors, metadata)
    return len(header) + sum(t.numel() * t.element_size() for t in tensors.values())


def write_safetensors(out: IO[bytes], tensors: Mapping[str, torch.Tensor],
                      metadata: Mapping[str, str] | None = None) -> int:
    """Write `tensors` to the binary file `out` in the safetensors format, one tensor at a
    time from its own memory (a non-contiguous or non-CPU tensor is copied alone), so no
    whole-file buffer ever exists. Readable by `safetensors.torch.load`; returns the bytes
    written. Tensors that share memory are written as separate copies (the caller leaves
    out a tied weight it does not want twice)."""
    header, order = safetensors_header(tensors, metadata)
    out.write(header)
    written = len(header)
    for name in order:
        t = tensors[name].detach()
        if not t.numel():
            continue
        flat = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)  # little-endian bytes
        view = memoryview(flat.numpy())
        for start in range(0, len(view), WRITE_CHUNK):
            out.write(view[start:start + WRITE_CHUNK])
        written += len(view)
        del view, flat
    return written
