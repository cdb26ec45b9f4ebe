"""Learner ranks under torchrun: the leader's plan of a step, the collective part of a commit."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors.torch import save as st_save

from ...learner_backends import Backend
from ...models.delta import publish_state
from ...models.io import state_dict_bytes

BACKEND_STATE, CRITIC, MASTERS = "backend", "critic", "policy"
"""Checkpoint files `<name>.safetensors`: the backend's optimizer state, the critic's weights,
the policy's float32 weights (only when versions are published in a narrower dtype)."""


@dataclass(frozen=True)
class Plan:
    """One step as the leader broadcasts it: the version, the KL coefficient, the shards."""

    version: int
    beta: float
    shards: list[str]

    def send(self, backend: Backend) -> None:
        backend.broadcast_json({"version": self.version, "beta": self.beta,
                                "shards": self.shards})

    @classmethod
    def receive(cls, backend: Backend) -> Plan | None:
        """The leader's next plan; None when the run is over."""
        plan = backend.broadcast_json(None)
        return None if plan is None else cls(int(plan["version"]), float(plan["beta"]),
                                             list(plan["shards"]))


def end(backend: Backend) -> None:
    """Tell the followers the run is over (the empty plan)."""
    backend.broadcast_json(None)


def gather(backend: Backend, model, leader: bool, checkpoint_due: bool, dtype: torch.dtype,
           ) -> tuple[dict[str, torch.Tensor] | None, dict[str, bytes]]:
    """The collective part of an applied step's commit, on every rank in the same order.

    The full weights are gathered and copied in the publish `dtype`; when a checkpoint is
    due, the backend's full optimizer state (and the critic's weights) too, as checkpoint
    files, and the float32 master weights when `dtype` is narrower (a learner resumed at that
    version continues from them). Returns (weights, checkpoint files) for the leader to
    write; (None, {}) on the other ranks.
    """
    weights, files = None, {}
    with backend.gathered():
        if leader:
            weights = publish_state(model, dtype)
            if checkpoint_due and dtype != torch.float32:
                files[MASTERS] = st_save(publish_state(model, torch.float32))
    if checkpoint_due:
        state = backend.state_dict()
        if backend.critic is not None:
            with backend.gathered():
                critic = state_dict_bytes(backend.critic.critic) if leader else b""
            files[CRITIC] = critic
        files[BACKEND_STATE] = st_save(state) if leader else b""
    return (weights, files) if leader else (None, {})
