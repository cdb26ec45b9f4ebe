"""Policy weights as deltas: what changed since the previous published version.

A published state is a flat {name: tensor} in the publish dtype, each tensor stored once (the
output head of tied embeddings is the embedding). A delta against the previous state holds
new values, never differences, so applying it reproduces the publisher's tensors bit for bit
whatever the dtype. Its tensors are named:

    full/<name>     the whole tensor (a new name, or too many elements changed)
    index/<name>    flat positions of the changed elements, 1-D int32 (int64 past 2**31)
    value/<name>    their new values, 1-D, in the tensor's dtype

A tensor whose bits are all unchanged is left out. Elements are compared as bit patterns,
so -0.0 against 0.0 counts as a change and a NaN as equal to the same NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

FULL, INDEX, VALUE = "full/", "index/", "value/"

_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bits(t: Tensor) -> Tensor:
    """`t` viewed as integers of its width (floating dtypes), or `t` itself."""
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t


def publish_state(model: nn.Module, dtype: torch.dtype, copy: bool = True) -> dict[str, Tensor]:
    """The model's state as fresh CPU tensors, floating ones cast to `dtype`; with
    `copy=False` the model's own tensors (detached) where they are already contiguous CPU
    tensors of that dtype, which the next update changes.

    A tensor that is the very same view as an earlier one (tied embeddings: the output head)
    is left out; loading tolerates the missing tied key. A model with LoRA adapters gives its
    merged weights under the base model's names (`lora.merged_state`).
    """
    from .lora import merged_state

    seen: set[tuple] = set()
    out: dict[str, Tensor] = {}
    for name, t in merged_state(model).items():
        ident = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and ident in seen:
            continue
        seen.add(ident)
        t = t.detach()
        t = t.to("cpu", dtype, copy=copy) if t.is_floating_point() else t.to("cpu", copy=copy)
        out[name] = t.contiguous()
    return out


def cast_state(state: dict[str, Tensor], dtype: torch.dtype) -> dict[str, Tensor]:
    """`state` with its floating tensors in `dtype` (the same tensors when they already are)."""
    return {k: t.to(dtype).contiguous() if t.is_floating_point() else t
            for k, t in state.items()}


def encode_delta(prev: dict[str, Tensor], cur: dict[str, Tensor]) -> dict[str, Tensor]:
    """The delta that turns `prev` into `cur` (see the module docstring).

    Sparse (index + value) when that takes fewer bytes than the whole tensor: with 4-byte
    indices, fewer than a third of the elements changed in bfloat16, half in float32.
    """
    delta: dict[str, Tensor] = {}
    for name, new in cur.items():
        old = prev.get(name)
        if old is None or old.shape != new.shape or old.dtype != new.dtype:
            delta[FULL + name] = new
            continue
        changed = (bits(old) != bits(new)).reshape(-1)  # (N,)
        n = int(changed.sum())
        if n == 0:
            continue
        index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
        index_size = 4 if index_dtype == torch.int32 else 8
        if n * (index_size + new.element_size()) < new.numel() * new.element_size():
            where = changed.nonzero().squeeze(1)  # (n,) int64
            delta[INDEX + name] = where.to(index_dtype)
            delta[VALUE + name] = new.reshape(-1)[where].contiguous()
        else:
            delta[FULL + name] = new
    return delta


def apply_delta(state: dict[str, Tensor], delta: dict[str, Tensor]) -> None:
    """Apply `delta` to `state` in place (its tensors must be contiguous and not shared)."""
    for key, t in delta.items():
        kind, _, name = key.partition("/")
        if kind + "/" == FULL:
            state[name] = t
        elif kind + "/" == INDEX:
            target, values = state.get(name), delta.get(VALUE + name)
            if target is None or values is None or values.dtype != target.dtype:
                raise ValueError(f"delta entry {name!r} does not fit the state it is applied to")
            target.view(-1)[t.long()] = values
        elif kind + "/" != VALUE:
            raise ValueError(f"unknown delta entry {key!r}")


def states_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Whether two states have the same names, dtypes, shapes and bits."""
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(bits(a[k]), bits(b[k]))
        for k in a)


def state_bytes(state: dict[str, Tensor]) -> int:
    """Bytes of the tensor data in `state`."""
    return sum(t.numel() * t.element_size() for t in state.values())
