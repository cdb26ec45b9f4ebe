"""The run's control plane: every small JSON object stages write for each other, typed.

Each record is a pydantic model; its key comes from a `RunKeys` method. A stage reads a record
with `Model.read(store, key)` (the empty record when the object does not exist yet, or None
with `optional=True`) and writes it with `record.write(store, key)`. Unknown fields are
errors both ways, so a misspelt field fails where it is written, not where it is read.

    key                              record            written by     read by
    policy/LATEST.json               PolicyPointer     snapshot,learn every stage
    learner/LATEST.json              CheckpointPointer learn          learn
    state/learn/progress.json        Progress          learn          rollout, prepare, monitor,
                                                                      accounting, report
    state/learn/buffered.json        Buffered          learn          rollout (flow control)
    state/learn/ledger-<n>.json      LedgerDelta       learn          accounting, replay
    state/<stage>/cursor.json        Cursor            score,prepare, downstream scanners
                                                       learn
    state/rollout/w<WW>.json         WorkerState       rollout        rollout, scanners
    state/prepare/<state>.json       PrepareState      prepare        prepare (only a preparer
                                                                      with statistics)
    state/prepare/passrate-<n>.json  PassRateSnapshot  prepare        prepare
    state/prepare/retired/<n>.json   RetiredChange     prepare        rollout (resampling)
    state/evaluate/latest.json       EvalPointer       evaluate       monitor, promote
    state/replay/source.json         ReplaySource      replay         replay, report readers
    state/replay/verify.json         ReplayCheck       replay         replay --verify callers
    DONE.json                        Done              learn          every stage, monitor
    ABORTED.json                     Aborted           supervisor,    every looping stage
                                                       local runner
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from .base import NotFound, Store, StoreError, json_bytes

if TYPE_CHECKING:
    from .keys import RunKeys


class Record(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @classmethod
    def read(cls, store: Store, key: str, optional: bool = False) -> Self | None:
        """The record at `key`; when there is none, the empty record (None if `optional`;
        `NotFound` naming the key when the record has no empty form). A key deleted between
        the check and the read (a record another stage replaces by a later one) reads as none
        too. A record that does not validate is a `StoreError` naming its key and store."""
        try:
            data = store.get_json(key) if store.exists(key) else None
        except NotFound:
            data = None
        if data is None:
            if optional:
                return None
            try:
                return cls()
            except ValidationError:
                raise NotFound(f"no {cls.__name__} record {key!r} in {store.uri}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise StoreError(f"{key!r} in {store.uri} is not a valid {cls.__name__} record "
                             f"(written by another version of ShardRL?): {e}") from e

    def write(self, store: Store, key: str) -> None:
        store.put_json(key, self.model_dump(mode="json"))


def read_run_json(store: Store, key: str) -> dict:
    """A run's run.json at `key`; a `StoreError` naming the key when it holds no config (a
    `config` mapping: edited by hand, or not a run's)."""
    data = store.get_json(key)
    if not (isinstance(data, dict) and isinstance(data.get("config"), dict)):
        raise StoreError(f"{key!r} in {store.uri} holds no run config (a `config` mapping): "
                         "not a run's run.json, or edited by hand")
    return data


def recorded_config(store: Store, key: str) -> dict:
    """The config a run recorded in its run.json at `key` (`read_run_json`), as JSON."""
    return read_run_json(store, key)["config"]


class PolicyPointer(Record):
    """The newest complete policy version (its weights and manifest are written first)."""

    version: int = 0
    time: float = 0.0
    step: int | None = None
    """The learner step that published it (None for the snapshot's version 0)."""


class CheckpointPointer(Record):
    """The newest complete learner checkpoint."""

    step: int = 0


class Progress(Record):
    """The learner's resumable state and commit point, written last in each commit."""

    version: int = 0
    """Policy version published by the last commit (= optimizer steps applied)."""
    commits: int = 0
    """Commits so far; names the next ledger delta."""
    counts: dict[str, int] = {}
    """Samples consumed, filtered, stale_dropped; skipped_steps."""
    processed_by_worker: dict[int, int] = {}
    """Shards committed per rollout worker."""
    groups_by_worker: dict[int, int] = {}
    """Prompt groups committed per rollout worker."""
    kept_groups_by_worker: dict[int, int] = {}
    """Of those, the groups zero-variance filtering kept."""
    staleness: dict[int, int] = {}
    """Samples per lag (learner version - policy version) at their step."""
    ledger: dict[int, list[str]] = {}
    """Shard names committed per open policy version (closed versions are dropped)."""
    kl: dict[str, float] = {}
    """The KL controller's state."""
    beta: float | None = None
    """The KL coefficient in force after the commit."""
    no_signal: dict[str, float] = {}
    """The steps in a row with no prompt group kept by filtering, up to this commit (the
    learner's `Barren` count: groups, rows, correct, reward): a learner that resumes goes
    on counting toward `learner.max_batches_without_signal`, and one stopped after the
    commit that reached it ends the run as that commit did. Empty: none (or written before
    this was recorded)."""
    time: float | None = None
    """When the commit's state was captured."""


class Buffered(Record):
    """Prompt groups per rollout worker in shards the learner read but has not committed."""

    groups_by_worker: dict[int, int] = {}
    kept_groups_by_worker: dict[int, int] = {}


class Taken(Record):
    """What the learner has taken into steps, written as each step starts (before its update
    and commit): the rollout workers count their lead from it (`rollout.lead_counted_at:
    take`) and the standby workers read from it how much the learner waits for data."""

    version: int = 0
    """The learner's version when the step started (the step publishes the next)."""
    groups_by_worker: dict[int, int] = {}
    """Prompt groups per rollout worker committed before the step or taken into it."""
    kept_groups_by_worker: dict[int, int] = {}
    """Of those, the groups zero-variance filtering kept."""
    stepping_s: float = 0.0
    """Seconds the learner process spent inside steps (update, commit, metrics) before this
    one; the rest of `elapsed_s` it waited for data and read it."""
    elapsed_s: float = 0.0
    """Seconds since the learner process started its loop (it restarts from 0 with it)."""
    learner: str = ""
    """Which learner process wrote it, new at each start: a change means the times above
    restarted."""


class LedgerEntry(Record):
    key: str
    outcome: Literal["admitted", "stale"]
    rows: int


class LearnerRestart(Record):
    """How a restarted learner resumed: its optimizer state came from the checkpoint of step
    `checkpoint` (None: fresh moments, there was no checkpoint)."""

    checkpoint: int | None = None


class LedgerDelta(Record):
    """The shards one commit consumed or dropped, in the order the step concatenated them,
    and what else a replay needs to repeat the step bit for bit."""

    version: int = 0
    stepped: bool = False
    """Whether the commit published a version (an applied update, or any `--once` round)."""
    applied: bool | None = None
    """Whether the update changed the weights (False: every row filtered, or a non-finite
    loss); None for a commit without an update, and in records written before the field."""
    shards: list[LedgerEntry] = []
    beta: float | None = None
    """The KL coefficient the update used (None: a commit of stale drops only)."""
    threads: list[int] = []
    """Torch threads of the update's forward and of its backward and optimizer step (CPU
    reductions depend on them); empty for a commit without an update."""
    restart: LearnerRestart | None = None
    """Set on the first commit of a restarted learner process."""


def committed_deltas(store: Store, prefix: str, commits: int) -> list[LedgerDelta]:
    """The ledger deltas under `prefix` (`RunKeys.ledger_prefix`) of the first `commits`
    commits (`Progress.commits`), in commit order. A delta is written before the
    `progress.json` that commits it: one numbered past `commits` belongs to a learner that
    stopped in between, and its shards are not committed (a restarted learner takes them
    again and writes that delta anew)."""
    found = sorted(k for k in store.list(prefix) if k.endswith(".json"))
    return [LedgerDelta.read(store, k) for k in found
            if int(k[len(prefix):-len(".json")]) <= commits]


class Cursor(Record):
    """The lowest policy version still open for a stage (see `stages.scan`)."""

    low: int = 0


class WorkerState(Record):
    """A rollout worker's reservation: the next free shard sequence number and its counts."""

    next_seq: int = 0
    version: int = 0
    """The policy version it generates with."""
    groups_written: int = 0
    kept_written: int = 0
    """Prompt groups written before the reserved shards (kept: when scored inline)."""
    reserved_from: int | None = None
    """The first of the reserved shards (up to `next_seq`) that the counts leave out: a
    worker stopped after writing some of them counts those when it starts again. None: the
    counts include every shard below `next_seq` (stored as it pauses)."""


class PrepareState(Record):
    """A preparer's statistics, saved after each ready shard it writes."""

    moments: dict[str, float] = {}
    """Running reward moments (reward normalization)."""
    recent: list[str] = []
    """Names of the last ready shards merged (exact recovery after a crash)."""
    forgotten: dict[int, int] = {}
    """Per rollout worker, the highest shard number among the merged names dropped from
    `recent`: a ready shard numbered up to it was merged long ago, however many shards a
    recovery's window holds."""
    passrate_snapshot: int | None = None
    """Number of the pass-rate snapshot the history starts from (No-Positive-Resampling)."""
    replay: list[str] = []
    """Ready shards merged since that snapshot: their outcomes complete the history."""
    retired_changes: int = 0
    """Retired-set changes written so far (numbers the next one)."""


class PassRateSnapshot(Record):
    """The pass-rate history at one point (`PassRateTracker.state_dict`)."""

    window: int
    retire_at: float
    min_samples: int
    history: dict[str, list[int]]
    retired: list[str] = []
    """Prompts retired for good (a snapshot without it: those its histories retire)."""


class RetiredChange(Record):
    """A change of the set of prompts No-Positive-Resampling no longer samples; `full`: the
    whole set, after which the earlier changes are deleted."""

    full: bool = False
    add: list[str] = []
    remove: list[str] = []
    """Prompts sampled again (retirement is for good now: an empty list, but records that
    name some are still applied)."""


class RetiredPrompts:
    """The prompts No-Positive-Resampling retired, followed from prepare's numbered changes:
    each refresh lists only the changes after the last one read."""

    def __init__(self, store: Store, keys: RunKeys) -> None:
        self.store, self.prefix = store, keys.retired_prefix()
        self.ids: set[str] = set()
        self.last: str | None = None

    def refresh(self) -> set[str]:
        for key in self.store.list(self.prefix, start_after=self.last):
            change = RetiredChange.read(self.store, key, optional=True)
            self.last = key
            if change is None:  # replaced by a later full set, which this listing holds
                continue
            self.ids = set(change.add) if change.full else (self.ids | set(change.add))
            self.ids -= set(change.remove)
        return self.ids


class EvalPointer(Record):
    """The newest evaluated policy version."""

    version: int = 0


class ReplaySource(Record):
    """What a replay run (`shardrl replay`) re-ran: the source run's ledger up to
    `to_version`, with the source's config changed by `overrides`."""

    run_id: str
    to_version: int | None = None
    overrides: list[str] = []


class TensorDifference(Record):
    """The first tensor of a published version that a replay did not reproduce bit for bit."""

    version: int
    tensor: str
    elements: int
    """Elements that differ (all of them when the tensor is missing or reshaped)."""
    max_abs_diff: float | None = None
    """Largest absolute difference of the differing elements (None: missing or reshaped)."""


class ReplayCheck(Record):
    """`shardrl replay --verify`: which published versions of the source were compared with
    the replay's weights, which were gone (deleted by retention), and the first difference."""

    source: str
    checked: list[int] = []
    missing: list[int] = []
    first_difference: TensorDifference | None = None
    divergence: str | None = None
    """A step the replay could not repeat as recorded (applied vs skipped, another beta)."""

    @property
    def ok(self) -> bool:
        return self.first_difference is None and self.divergence is None


class Done(Record):
    """Written by the learner after its last commit: looping stages stop on it."""

    steps: int = 0
    counts: dict[str, int] = {}
    time: float = 0.0
    staleness: dict[int, int] = {}
    converged: bool = False
    """The run finished before `learner.total_steps` because every sample of its last
    prompt groups was correct (nothing left to learn from them); `steps` is the last version."""


class Aborted(Record):
    """Written when a looping stage failed for good (its supervisor or the local runner ran
    out of restarts): every other looping stage stops on it, as on DONE.json, so no pod waits
    for work that will never come. The first failure's record is kept."""

    stage: str = ""
    worker: int = 0
    exit_code: int = 1
    restarts: int = 0
    """Restarts spent before giving up."""
    reason: str = ""
    time: float = 0.0

    def write_first(self, store: Store, key: str) -> Aborted:
        """Write this record unless a stage's failure is recorded already; the one in force
        (of two at once, exactly one where the store creates objects atomically: the folder
        store, and S3 servers that honour conditional writes; see `Store.put_if_absent`)."""
        if store.put_if_absent(key, json_bytes(self.model_dump(mode="json"))):
            return self
        return Aborted.read(store, key, optional=True) or self

    def describe(self) -> str:
        who = self.stage if self.worker == 0 else f"{self.stage} worker {self.worker}"
        how = (f"failed for good (exit {self.exit_code} after {self.restarts} restart(s))"
               if self.restarts else f"stopped the run (exit {self.exit_code})")
        return f"{who} {how}{': ' + self.reason if self.reason else ''}"
