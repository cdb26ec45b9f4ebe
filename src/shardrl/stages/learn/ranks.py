"""Learner ranks under torchrun: the leader's plan of a step, the collective part of a commit."""

from __future__ import annotations

from dataclasses import dataclass

from safetensors.torch import save as st_save

from ...learner_backends import Backend
from ...models.io import state_dict_bytes

BACKEND_STATE, CRITIC = "backend", "critic"
"""Checkpoint files `<name>.safetensors`: the backend's optimizer state, the critic's weights."""


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


def gather(backend: Backend, model, leader: bool, checkpoint_due: bool
           ) -> tuple[bytes | None, dict[str, bytes]]:
    """The collective part of an applied step's commit, on every rank in the same order.

    The full weights are gathered and serialized; when a checkpoint is due, the backend's
    full optimizer state (and the critic's weights) too, as checkpoint files. Returns
    (weights, checkpoint files) for the leader to write; (None, {}) on the other ranks.
    """
    weights, files = None, {}
    with backend.gathered():
        if leader:
            weights = state_dict_bytes(model)
    if checkpoint_due:
        state = backend.state_dict()
        if backend.critic is not None:
            with backend.gathered():
                critic = state_dict_bytes(backend.critic.critic) if leader else b""
            files[CRITIC] = critic
        files[BACKEND_STATE] = st_save(state) if leader else b""
    return (weights, files) if leader else (None, {})
