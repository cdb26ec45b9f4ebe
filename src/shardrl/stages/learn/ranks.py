"""Learner ranks under torchrun: the leader's plan of a step, the collective part of a commit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...learner_backends import Backend
from ...models.delta import publish_state
from ...models.lora import has_lora
from ..checkpoint import CheckpointFiles

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


State = dict[str, torch.Tensor]


def gather(backend: Backend, model, leader: bool, checkpoint_due: bool, dtype: torch.dtype,
           lend_weights: bool = False) -> tuple[State | None, dict[str, State]]:
    """The collective part of an applied step's commit, on every rank in the same order.

    The full weights are gathered and copied in the publish `dtype`; when a checkpoint is
    due, the backend's full optimizer state (and the critic's weights) too, as checkpoint
    files, and the float32 master weights when `dtype` is narrower (a learner resumed at that
    version continues from them). The leader's writer serializes them off the step's path
    while the next update runs. A backend that lends its state (the torch one) gives its
    live tensors, and its next update waits, after the backward pass, until the writer has
    written them (`CheckpointFiles.loan`); elsewhere every tensor is a copy. Returns
    (weights, checkpoint files as name -> tensors) for the leader to write; (None, {}) on the
    other ranks.

    With `lend_weights` (a writer that keeps no reference to them once written: the commit
    child, which receives their bytes) the published weights are lent too when the model
    trains in the publish dtype, instead of copied: a copy on the step's path that the writer
    then serializes anyway. The loan, the checkpoint's if one is due, rides on the files; a
    cast publish (a narrower dtype) is a copy and lends nothing, so the next update does not
    wait for its writes.
    """
    weights, files = None, CheckpointFiles()
    live = checkpoint_due and leader and backend.lends_state
    live_weights = (lend_weights and leader and backend.lends_state
                    and next(model.parameters()).dtype == dtype and not has_lora(model))
    with backend.gathered():
        if leader:
            weights = publish_state(model, dtype, copy=not live_weights)
            if checkpoint_due and dtype != torch.float32 and not has_lora(model):
                files[MASTERS] = publish_state(model, torch.float32, copy=not live)
    if checkpoint_due:
        state = backend.state_dict(copy=not live, everywhere=False)  # a collective call
        if backend.critic is not None:
            with backend.gathered():  # tied weights: each key gets its own copy in the file
                critic = ({k: t.detach() if live else t.detach().to("cpu", copy=True)
                           for k, t in backend.critic.critic.state_dict().items()}
                          if leader else {})
            files[CRITIC] = critic
        files[BACKEND_STATE] = state if leader else {}
    if live or live_weights:
        files.loan = backend.lend()
    return (weights, files) if leader else (None, {})
