"""Where the learner's time goes: the per-step figures it logs beside the loss."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Profile:
    started: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0
    """Wall seconds inside updates."""
    busy_cpu_s: float = 0.0
    """CPU seconds of updates (the learner's thread): busy time without waits for a shared
    core."""
    stepping_s: float = 0.0
    """Wall seconds inside steps (update, commit, metrics); the rest of the loop's time
    goes to waiting for data and reading it (see `Taken`)."""
    read_s: float = 0.0
    """Seconds since the last step the learner waited for shard reads (they run on the
    buffer's reader thread; a read done during an update costs the step nothing)."""
    wait_s: float = 0.0
    """Seconds since the last step waiting for new ready shards."""
    hops: list[float] = field(default_factory=list)
    """Hand-off latency since the last step: for each shard read while the learner was
    waiting for data, seconds from its generation to its reading (scoring, prepare and the
    store writes included; queueing behind a busy learner is not)."""

    def updated(self, started: float, cpu_started: float) -> float:
        """Count an update that began at `started` (monotonic) / `cpu_started` (thread CPU
        time); its end."""
        now = time.monotonic()
        self.busy_s += now - started
        self.busy_cpu_s += time.thread_time() - cpu_started
        return now

    def step_metrics(self, started: float, updated: float, committed: float, samples: int,
                     tokens: int) -> dict[str, float]:
        """The step's throughput and profile; resets the per-step parts."""
        wall = max(committed - self.started, 1e-9)
        took = max(committed - started, 1e-9)
        metrics = dict(
            samples=float(samples), tokens=float(tokens), samples_per_s=samples / took,
            tokens_per_s=tokens / took, update_s=updated - started, commit_s=committed - updated,
            busy_fraction=self.busy_s / wall, busy_cpu_fraction=self.busy_cpu_s / wall,
            busy_s=self.busy_s, busy_cpu_s=self.busy_cpu_s, read_s=self.read_s,
            wait_s=self.wait_s,
        )
        hops, self.hops = sorted(self.hops), []
        if hops:
            metrics.update(hop_s=hops[len(hops) // 2], hop_max_s=hops[-1])
        self.read_s = self.wait_s = 0.0
        return metrics
