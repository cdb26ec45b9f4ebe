"""`shardrl model import-gguf`: a GGUF file as a Hugging Face folder with safetensors weights.

transformers reads a GGUF file's config, tokenizer (chat template included) and tensors, and
dequantizes the tensors (it needs the `gguf` and `accelerate` packages: the `models` extra).
The model it returns still carries the file's quantization marker in its config, which would
make `from_pretrained` on the saved folder look for the GGUF file again, so the folder is
written here: config.json without the marker, generation_config.json, the tokenizer files,
and the state dict as one safetensors file with a tied output head stored once (as
`save_pretrained` stores it; loading ties it back).

The folder is written under a temporary name beside `out` and renamed into place once it has
been reloaded and checked, so a failure leaves nothing at `out`.
"""

from __future__ import annotations

import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GGUF_MAGIC = b"GGUF"
WEIGHTS_FILE = "model.safetensors"
DTYPES = ("float32", "bfloat16")


class GGUFImportError(RuntimeError):
    """The file cannot be imported, or the folder cannot be written."""


def check_gguf_file(path: str | Path) -> Path:
    """`path` as a Path when it is a readable GGUF file; else `GGUFImportError`."""
    file = Path(path)
    if not file.is_file():
        raise GGUFImportError(f"{file}: no such file")
    with open(file, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{file} is not a GGUF file (it starts with {magic!r}, "
                              f"not {GGUF_MAGIC!r})")
    return file


def _output_folder(file: Path, out: Path) -> Path:
    """`out`, resolved, when importing into it (and replacing it, with `--force`) cannot
    delete what must stay: the GGUF file itself, the current folder or one above it, or a
    file of that name."""
    target, here = out.resolve(), Path.cwd().resolve()
    if target == here or target in here.parents:
        raise GGUFImportError(f"--out {out} is the current folder or one above it: replacing "
                              "it would delete what it holds; choose a folder of its own")
    # the file where it is named (a link, as in a model cache) and where it points
    named = out.absolute()
    held = (file.absolute(), file.resolve(), file.parent.resolve() / file.name)
    if any(folder in (source, *source.parents) for folder in (target, named) for source in held):
        raise GGUFImportError(f"--out {out} holds the GGUF file {file}: replacing it would "
                              "delete the file; choose another --out")
    if target.exists() and not target.is_dir():
        raise GGUFImportError(f"--out {out} is a file, not a folder: choose another --out")
    return target


def _refuse_unsupported(file: Path) -> None:
    """GGUFImportError for what transformers' GGUF loader drops without a word, which would
    give a folder whose model computes other logits than the file's: RoPE scaling (linear,
    YaRN) and per-frequency RoPE factors (`rope_freqs.weight`, as Llama 3.1 files carry)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(file))
    except (ValueError, OSError, struct.error) as exc:
        raise GGUFImportError(f"cannot read {file} as GGUF: {exc}") from exc

    def text(name: str) -> str | None:
        field = reader.fields.get(name)
        if field is None or not field.data:
            return None
        value = field.parts[field.data[0]]
        return bytes(value).decode(errors="replace") if value.dtype.kind == "u" else \
            str(value[0])

    arch = text("general.architecture") or "llama"
    scaling = text(f"{arch}.rope.scaling.type")
    if scaling not in (None, "", "none"):
        raise GGUFImportError(
            f"{file} scales its rotary positions ({arch}.rope.scaling.type = {scaling}), which "
            "transformers' GGUF reader drops: the folder would compute other logits than the "
            "file past the first position; not imported (convert from the original "
            "checkpoint instead)")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFImportError(
            f"{file} carries per-frequency rotary factors (rope_freqs.weight, as Llama 3.1 "
            "files do), which transformers' GGUF reader drops: the folder would compute other "
            "logits than the file; not imported (convert from the original checkpoint "
            "instead)")


def _require_packages() -> None:
    missing = []
    for name in ("gguf", "accelerate"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise GGUFImportError(
            f"reading GGUF files needs the package(s) {', '.join(missing)}: "
            "pip install 'shardrl[models]' (make models installs them)")


def weights_to_save(model: Any) -> tuple[dict[str, Any], list[str]]:
    """(state dict to write, keys left out): contiguous CPU tensors, the output head left
    out when the config ties it to the input embeddings, any other aliased tensor copied
    (safetensors refuses tensors that share memory)."""
    state = model.state_dict()
    dropped: list[str] = []
    if getattr(model.config, "tie_word_embeddings", False):
        head, embed = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and head.weight is embed.weight:
            ptr = embed.weight.data_ptr()
            names = [k for k, v in state.items() if v.data_ptr() == ptr]
            # the input embedding keeps its key; every other name of the same tensor goes
            keep = next(k for k in names if k.endswith("embed_tokens.weight")) \
                if any(k.endswith("embed_tokens.weight") for k in names) else names[0]
            dropped = [k for k in names if k != keep]
    seen: set[int] = set()
    tensors = {}
    for key, value in state.items():
        if key in dropped:
            continue
        t = value.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[key] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return tensors, dropped


def import_gguf(file: str | Path, out: str | Path, *, dtype: str = "float32",
                force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Write the model of GGUF `file` as a Hugging Face folder `out`; return `out`.

    `dtype`: the weights' dtype in the folder ("float32" or "bfloat16"). `force` replaces an
    existing `out`; without it an existing non-empty `out` is an error. Progress goes to
    `log`, one line per step.
    """
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    file = check_gguf_file(file)
    out = _output_folder(file, Path(out))
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not force:
        raise GGUFImportError(f"{out} already exists and is not empty: choose another --out "
                              "or pass --force to replace it")
    from ..quiet import quiet_libraries

    quiet_libraries()  # before tqdm is first imported: it reads its switches then
    _require_packages()
    _refuse_unsupported(file)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.monotonic()
    log(f"reading {file} ({file.stat().st_size / 1e6:.1f} MB)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=getattr(torch, dtype))
    except (ValueError, OSError, KeyError, RuntimeError, NotImplementedError,
            struct.error, EOFError) as exc:  # struct.error, EOFError: a truncated file
        raise GGUFImportError(f"transformers cannot read {file}: {exc}") from exc
    model.eval()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {config.model_type}, {getattr(config, 'num_hidden_layers', '?')} layers, "
        f"{params / 1e6:.1f}M parameters, dequantized to {dtype} "
        f"({time.monotonic() - started:.1f} s)")
    log(f"tokenizer: {len(tokenizer)} tokens, eos {tokenizer.eos_token!r} "
        f"({tokenizer.eos_token_id}), pad {tokenizer.pad_token!r} ({tokenizer.pad_token_id}), "
        f"chat template: {'yes' if tokenizer.chat_template else 'no'}")

    # the folder loads as a plain model: no quantization marker, no reference to the file
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.importing"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        tensors, dropped = weights_to_save(model)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        size = (tmp / WEIGHTS_FILE).stat().st_size
        tied = f", tied output head stored once ({', '.join(dropped)})" if dropped else ""
        log(f"wrote {WEIGHTS_FILE}: {len(tensors)} tensors, {size / 1e6:.1f} MB{tied}")
        config.save_pretrained(str(tmp))
        if model.generation_config is not None:
            model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        log("wrote config.json, generation_config.json and the tokenizer files")
        _check_reload(model, tmp, dtype)
        log("checked: the folder reloads as a plain model with the same logits")
        del tensors
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"done: {out} ({time.monotonic() - started:.1f} s)")
    return out


def _check_reload(model: Any, folder: Path, dtype: str) -> None:
    """Reload `folder` the way the snapshot stage does and compare logits on a few tokens."""
    import torch

    from .io import load_causal_lm, load_tokenizer

    reloaded = load_causal_lm(folder, dtype=getattr(torch, dtype))
    tokenizer = load_tokenizer(folder)
    if getattr(reloaded.config, "quantization_config", None) is not None:
        raise GGUFImportError(f"{folder}/config.json still has a quantization_config")
    ids = tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"] or [0]
    x = torch.tensor([ids[:16]])
    with torch.no_grad():
        want, got = model(input_ids=x).logits, reloaded(input_ids=x).logits
    if not torch.equal(want, got):
        diff = float((want - got).abs().max())
        raise GGUFImportError(f"the written folder does not reproduce the model's logits "
                              f"(max difference {diff:.3g})")
