"""Token batches from shard rows: prompt + response concatenated, right padded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ..store.shards import list_column_to_padded


@dataclass
class SeqBatch:
    """Rows of a shard as tensors. Response position t of row i is token start[i] + t."""

    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    response_start: torch.Tensor  # (B,)
    response_mask: torch.Tensor  # (B, T) float, 1 on response tokens
    response_lengths: torch.Tensor  # (B,)

    @property
    def width(self) -> int:
        """T: response positions of `token_logprobs` outputs for this batch."""
        return self.response_mask.shape[1]

    def pad_response(self, values: np.ndarray) -> torch.Tensor:
        """(B, T') right-padded response values -> (B, T) aligned with this batch."""
        out = torch.zeros(self.response_mask.shape, dtype=torch.float32)
        t = min(values.shape[1], self.width)
        out[:, :t] = torch.from_numpy(np.ascontiguousarray(values[:, :t], dtype=np.float32))
        return out * self.response_mask


POLICY_MASK = "policy_mask"
"""Optional list column, one 0/1 per response token: 1 where the policy generated it (see
`tasks.environments`). Without it every response token is the policy's."""


def build_batch(table: pa.Table, pad_id: int) -> SeqBatch:
    """The rows as one right-padded batch; `response_mask` is 1 on the response tokens the
    policy generated (all of them, unless a `policy_mask` column says otherwise), which are
    the only ones given logprobs, loss and metrics."""
    prompts, plen = list_column_to_padded(table, "prompt_token_ids", pad_id)  # (B, P)
    resps, rlen = list_column_to_padded(table, "response_token_ids", pad_id)  # (B, R)
    batch = len(plen)
    total = plen + rlen
    width = int(total.max())
    ids = np.full((batch, width), pad_id, dtype=np.int64)
    for i in range(batch):
        ids[i, : plen[i]] = prompts[i, : plen[i]]
        ids[i, plen[i]: total[i]] = resps[i, : rlen[i]]
    attn = (np.arange(width)[None, :] < total[:, None]).astype(np.int64)  # (B, L)
    t = width - int(plen.min())
    mask = (np.arange(t)[None, :] < rlen[:, None]).astype(np.float32)  # (B, T)
    if POLICY_MASK in table.column_names:  # multi-turn: the environment's tokens are out
        policy, _ = list_column_to_padded(table, POLICY_MASK, 0)  # (B, R)
        mask[:, : policy.shape[1]] *= policy.astype(np.float32)  # R <= T
    return SeqBatch(
        input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attn),
        response_start=torch.from_numpy(plen.astype(np.int64)),
        response_mask=torch.from_numpy(mask), response_lengths=torch.from_numpy(rlen),
    )


def padded_column(table: pa.Table, column: str) -> np.ndarray:
    """A float list column as a right-padded (B, T') float32 matrix."""
    values, _ = list_column_to_padded(table, column, 0.0)
    return values.astype(np.float32, copy=False)


def unpad(values: torch.Tensor, lengths: torch.Tensor) -> list[list[float]]:
    """(B, T) -> per-row lists of the first lengths[i] values."""
    rows = values.tolist()
    return [row[: int(n)] for row, n in zip(rows, lengths.tolist(), strict=True)]
