"""Data filters of ScaleRL: zero-variance groups and No-Positive-Resampling."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from torch import Tensor

from shardrl.algo.utils import group_index, group_sum


def zero_variance_keep(rewards: Tensor, group_ids: Tensor, tol: float) -> Tensor:
    """Which samples keep a learning signal: False for every sample of a group whose rewards
    have population std <= tol (all equal, or a group of one), True otherwise.

    rewards: (B,); group_ids: (B,) int64, any values. Returns bool (B,).
    """
    r = rewards.detach().double()
    index, num_groups = group_index(group_ids)
    counts = group_sum(r.new_ones(r.shape), index, num_groups)  # (G,)
    means = group_sum(r, index, num_groups) / counts
    variances = group_sum((r - means[index]).square(), index, num_groups) / counts
    return (variances.sqrt() > tol)[index]


class PassRateTracker:
    """Per-prompt pass rate over the last `window` samples, driving No-Positive-Resampling.

    A prompt retires once it has at least `min_samples` recorded samples and its pass rate
    over the last `window` of them is >= `retire_at`; later epochs skip retired prompts. A
    retirement is for good (ScaleRL removes solved prompts from every later epoch): samples
    of the prompt generated before the rollout saw it retire still arrive and are recorded,
    but failures among them do not bring it back.
    """

    def __init__(self, window: int, retire_at: float, min_samples: int) -> None:
        if window < 1 or not 1 <= min_samples <= window:
            raise ValueError(
                "need window >= 1 and 1 <= min_samples <= window, "
                f"got window={window}, min_samples={min_samples}"
            )
        self.window = window
        self.retire_at = retire_at
        self.min_samples = min_samples
        self._history: dict[str, deque[bool]] = {}
        self._retired: set[str] = set()

    def _retires(self, history: deque[bool]) -> bool:
        return len(history) >= self.min_samples and sum(history) / len(history) >= self.retire_at

    def update(self, prompt_ids: Iterable[str], correct: Iterable[bool] | Tensor) -> set[str]:
        """Record one outcome per sample: `prompt_ids[i]` was solved iff `correct[i]`.

        Returns the prompts this update retired; only the prompts it touched are looked at,
        so an update costs its samples, not the prompts seen."""
        outcomes = correct.tolist() if isinstance(correct, Tensor) else list(correct)
        ids = list(prompt_ids)
        if len(ids) != len(outcomes):
            raise ValueError(f"{len(ids)} prompt ids but {len(outcomes)} outcomes")
        for prompt_id, ok in zip(ids, outcomes, strict=True):
            history = self._history.get(prompt_id)
            if history is None:
                history = self._history[prompt_id] = deque(maxlen=self.window)
            history.append(bool(ok))
        added = {prompt_id for prompt_id in set(ids) - self._retired
                 if self._retires(self._history[prompt_id])}
        self._retired |= added
        return added

    def pass_rate(self, prompt_id: str) -> float | None:
        """Share of solved samples among the prompt's last `window`; None if never seen."""
        history = self._history.get(prompt_id)
        if not history:
            return None
        return sum(history) / len(history)

    def retired(self) -> set[str]:
        """Prompts whose recent pass rate reached `retire_at` with at least `min_samples`
        at some update."""
        return set(self._retired)

    def keep_retired(self, prompt_ids: Iterable[str]) -> None:
        """Count `prompt_ids` as retired: those published before a restart whose outcomes
        the history no longer holds (a ready shard quarantined since)."""
        self._retired |= set(prompt_ids)

    def retired_count(self) -> int:
        return len(self._retired)

    def __len__(self) -> int:
        """Prompts with a recorded history."""
        return len(self._history)

    def state_dict(self) -> dict[str, Any]:
        """Settings, histories (0/1 lists, oldest first) and retired prompts, JSON-serialisable."""
        return {
            "window": self.window,
            "retire_at": self.retire_at,
            "min_samples": self.min_samples,
            "history": {pid: [int(x) for x in h] for pid, h in self._history.items()},
            "retired": sorted(self._retired),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()`."""
        self.window = int(state["window"])
        self.retire_at = float(state["retire_at"])
        self.min_samples = int(state["min_samples"])
        self._history = {
            str(pid): deque((bool(x) for x in h), maxlen=self.window)
            for pid, h in state["history"].items()
        }
        # a state saved without its retired prompts: those its histories retire
        self._retired = set(state.get("retired", ())) | {
            pid for pid, h in self._history.items() if self._retires(h)}
