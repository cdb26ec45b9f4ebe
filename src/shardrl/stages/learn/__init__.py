"""learn: admit ready shards within staleness k, update the policy, publish versions.

Each optimizer step publishes policy version `step`. The commit order per step is: weights of
the new version, the ledger delta (which shards this commit consumed or dropped), an
optimizer checkpoint when due, `state/learn/progress.json` (the learner's resumable state and
the commit point), then `policy/LATEST.json`; checkpoints beyond `keep_checkpoints` are
deleted only after that. A restarted learner resumes from progress.json: versions stay
continuous and no shard is consumed twice; its optimizer state comes from the newest
checkpoint at or before that version (one written for the commit in flight is passed over
and deleted, see `stages/checkpoint.py`).

The step's store writes run in that order on a background thread while the next batch is
read and computed; at most one commit is in flight, and the learner waits for it before the
next commit, before DONE.json and before it exits. The weights and optimizer state are
serialized before the next update changes them. The thread hands all but the checkpoint to a
child process (`learner.commit_writer`, see offload.py), whose interpreter is not the one the
update runs on; the live doctor's checks (every `learner.doctor_every` steps) run there too.
A crash can lose only the commit in flight, which a restart redoes from the previous
progress.json, as before.

With `--once` (the synchronous pipeline: one learner process per round, started after the
round's rollout, score and prepare have finished) the learner makes one step on what the round
brought, even when zero-variance filtering kept fewer than `batch_prompts` groups, and
checkpoints its optimizer state at every step, so the next round's process continues exactly
where this one stopped.

Under `torchrun` (DeepSpeed with `learner.backend.ranks > 1`) rank 0 is the leader: it alone
lists, admits, logs and writes to the store. Before each update it broadcasts the step's plan
(the shards that make the batch, the version, the KL coefficient); the other ranks read those
shards, compute the same loss and join every collective of the step (the update, gathering
ZeRO-3 weights for publishing, the optimizer checkpoint) in the same order. An empty plan
tells them the run is over.

    loop.py     the learner: resume, the leader's loop, one step, one commit
    buffer.py   ready shards read and not yet committed; which of them make the next batch
    commit.py   the ledger (what was committed) and the ordered background store writes
    offload.py  where a commit's writes (and the doctor's checks) run: here, or a child process
    ranks.py    the step plan, the followers' loop, the collective part of a commit
    profile.py  where a step's time went (busy, reading, waiting, hand-off latency)
"""

from __future__ import annotations

from ..context import StageContext
from .loop import Learner, RunFinished


def main(ctx: StageContext) -> int:
    try:
        learner = Learner(ctx)
    except RunFinished:
        # a learner stopped after it finished the run (converged early: before total_steps)
        # has nothing left to do, and no worker would write the shards it would wait for
        ctx.log.info("the run is done (%s): nothing to learn", ctx.keys.done())
        return 0
    return learner.run() if learner.leader else learner.follow()


__all__ = ["Learner", "RunFinished", "main"]
