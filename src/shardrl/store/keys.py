"""The key layout of one run: every object of run `r` lives under `runs/r/`.

    runs/r/run.json                                  run manifest (snapshot)
    runs/r/ref/<file>                                frozen reference model
    runs/r/policy/v000012/<file>, policy/LATEST.json policy versions and the newest pointer
    runs/r/rollouts/v000012/w00-000034.parquet       rollout shard: version, worker, sequence
    runs/r/scored/v000012/w00-000034.parquet         named after its rollout shard
    runs/r/ready/v000012/w00-000034.parquet          named after its rollout shard
    runs/r/learner/ckpt-000100/<file>, learner/LATEST.json
    runs/r/eval/v000012.parquet, eval/v000012.json
    runs/r/metrics/<stage>/<name>.parquet            metrics chunk (flat)
    runs/r/metrics/<stage>/w03/0001712/1712000000123456.parquet   metrics chunk (bucketed)
    runs/r/state/<stage>/<name>
    runs/r/quarantine/<stage>/<run-relative key>, and <that key>.error.json
    runs/r/DONE.json, runs/r/ABORTED.json

Zero-padded numbers make the lexicographic order of keys their numeric order.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Literal

ShardKind = Literal["rollouts", "scored", "ready"]
SHARD_KINDS: tuple[ShardKind, ...] = ("rollouts", "scored", "ready")

MAX_VERSION = 999_999
MAX_WORKER = 99
MAX_SEQ = 999_999
MAX_STEP = 999_999
MAX_TIME_US = 10**16 - 1
MAX_COUNT = 999_999_999
METRICS_BUCKET_US = 10**9
"""Width in microseconds (about 17 minutes) of one folder of bucketed metric chunks: a writer
flushes at most every few seconds, so a folder holds a few hundred chunks however long the
run, and a listing from a cursor stays small on a folder store too."""

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")
_SHARD = re.compile(
    r"runs/(?P<run>[A-Za-z0-9][A-Za-z0-9._-]*)/(?P<kind>rollouts|scored|ready)"
    r"/v(?P<version>\d{6})/w(?P<worker>\d{2})-(?P<seq>\d{6})\.parquet\Z"
)


def new_run_id(prefix: str) -> str:
    """A fresh run id: `prefix`, the local time to the second and 4 random hex digits, so two
    runs started in the same second get different ids."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _name(value: str, what: str) -> str:
    """`value` if it is a single safe key segment (letters, digits, `._-`), else ValueError."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{what} must match [A-Za-z0-9][A-Za-z0-9._-]*, got {value!r}")
    return value


def _relative_path(value: str, what: str) -> str:
    """`value` if it is one or more safe segments joined by `/`, else ValueError."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty relative path, got {value!r}")
    for segment in value.split("/"):
        _name(segment, what)
    return value


def _number(value: int, top: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
        raise ValueError(f"{what} must be an integer in [0, {top}], got {value!r}")
    return value


def version_dir(version: int) -> str:
    """`v000012` for version 12."""
    return f"v{_number(version, MAX_VERSION, 'version'):06d}"


@dataclass(frozen=True)
class ShardKey:
    """The parts of a shard key `runs/<run_id>/<kind>/v<version>/w<worker>-<seq>.parquet`."""

    run_id: str
    kind: ShardKind
    version: int
    worker: int
    seq: int

    @property
    def key(self) -> str:
        """The key these parts name."""
        return RunKeys(self.run_id).shard(self.kind, self.version, self.worker, self.seq)

    @property
    def name(self) -> str:
        """`v000012/w00-000034.parquet`: the shard's name within its kind, the same for the
        rollout, scored and ready shards of one reservation."""
        return f"{version_dir(self.version)}/w{self.worker:02d}-{self.seq:06d}.parquet"


def shard_name(key: str) -> str:
    """The last segment of a shard key (`w00-000034.parquet`), also of a quarantined copy."""
    return key.rsplit("/", 1)[-1]


_SHARD_NAME = re.compile(r"w(?P<worker>\d+)-(?P<seq>\d+)\.parquet\Z")


def shard_numbers(name: str) -> tuple[int, int]:
    """(worker, sequence number) of a shard name (`shard_name`); ValueError if malformed."""
    m = _SHARD_NAME.match(name)
    if m is None:
        raise ValueError(f"not a shard name: {name!r} (expected w<worker>-<number>.parquet)")
    return int(m["worker"]), int(m["seq"])


_EVAL_SUMMARY = re.compile(r"runs/[^/]+/eval/v(?P<version>\d{6})\.json\Z")


_FOLDERS = {"policy": re.compile(r"runs/[^/]+/policy/v(?P<number>\d{6})/"),
            "learner": re.compile(r"runs/[^/]+/learner/ckpt-(?P<number>\d{6})/")}


def folder_number(key: str, area: Literal["policy", "learner"]) -> int | None:
    """The policy version of a key under `policy/v<6 digits>/` (area "policy") or the step of
    one under `learner/ckpt-<6 digits>/` (area "learner"); None for any other key (the
    LATEST.json pointers)."""
    m = _FOLDERS[area].match(key) if isinstance(key, str) else None
    return int(m["number"]) if m else None


def parse_eval_summary_key(key: str) -> int:
    """The policy version of an `eval/v<6 digits>.json` key; ValueError if malformed."""
    m = _EVAL_SUMMARY.match(key) if isinstance(key, str) else None
    if m is None:
        raise ValueError(f"not an evaluation summary key: {key!r}")
    return int(m["version"])


def parse_shard_key(key: str) -> ShardKey:
    """Split a rollout/scored/ready shard key into its parts; ValueError if malformed."""
    m = _SHARD.match(key) if isinstance(key, str) else None
    if m is None:
        raise ValueError(
            f"not a shard key: {key!r} (expected runs/<run_id>/<rollouts|scored|ready>/"
            "v<6 digits>/w<2 digits>-<6 digits>.parquet)"
        )
    return ShardKey(
        run_id=m["run"], kind=m["kind"],  # type: ignore[arg-type]
        version=int(m["version"]), worker=int(m["worker"]), seq=int(m["seq"]),
    )


@dataclass(frozen=True)
class RunKeys:
    """Builds every key of run `run_id`; prefixes end with `/` and suit `Store.list`."""

    run_id: str

    def __post_init__(self) -> None:
        _name(self.run_id, "run_id")

    @property
    def root(self) -> str:
        """`runs/<run_id>/`: the prefix of every key of the run."""
        return f"runs/{self.run_id}/"

    def relative(self, key: str) -> str:
        """`key` without the run's root; ValueError when the key is not in this run."""
        if not key.startswith(self.root) or key == self.root:
            raise ValueError(f"key {key!r} is not under {self.root}")
        return key[len(self.root):]

    def run_json(self) -> str:
        return f"{self.root}run.json"

    def done(self) -> str:
        """`DONE.json`: written by the learner at the end; looping stages stop on it."""
        return f"{self.root}DONE.json"

    def aborted(self) -> str:
        """`ABORTED.json`: a looping stage failed for good; every looping stage stops."""
        return f"{self.root}ABORTED.json"

    def ref_prefix(self) -> str:
        return f"{self.root}ref/"

    def ref_file(self, name: str) -> str:
        return self.ref_prefix() + _relative_path(name, "file name")

    def policy_prefix(self, version: int) -> str:
        return f"{self.root}policy/{version_dir(version)}/"

    def policy_file(self, version: int, name: str) -> str:
        return self.policy_prefix(version) + _relative_path(name, "file name")

    def latest_policy(self) -> str:
        """`policy/LATEST.json`: points at the newest complete policy version."""
        return f"{self.root}policy/LATEST.json"

    def kind_prefix(self, kind: ShardKind) -> str:
        """`rollouts/`, `scored/` or `ready/` of the run."""
        if kind not in SHARD_KINDS:
            raise ValueError(f"shard kind must be one of {SHARD_KINDS}, got {kind!r}")
        return f"{self.root}{kind}/"

    def version_prefix(self, kind: ShardKind, version: int) -> str:
        """All shards of one kind produced by policy `version`."""
        return f"{self.kind_prefix(kind)}{version_dir(version)}/"

    def shard(self, kind: ShardKind, version: int, worker: int, seq: int) -> str:
        name = f"w{_number(worker, MAX_WORKER, 'worker'):02d}-{_number(seq, MAX_SEQ, 'seq'):06d}"
        return f"{self.version_prefix(kind, version)}{name}.parquet"

    def rollout(self, version: int, worker: int, seq: int) -> str:
        return self.shard("rollouts", version, worker, seq)

    def scored_for(self, rollout_key: str) -> str:
        """The scored shard made from `rollout_key` (same version, worker and sequence)."""
        return self._derived(rollout_key, "scored")

    def ready_for(self, rollout_key: str) -> str:
        """The ready shard made from `rollout_key` (or from its scored shard)."""
        return self._derived(rollout_key, "ready")

    def _derived(self, key: str, kind: ShardKind) -> str:
        parts = parse_shard_key(key)
        if parts.run_id != self.run_id:
            raise ValueError(f"shard {key!r} belongs to run {parts.run_id!r}, not {self.run_id!r}")
        return self.shard(kind, parts.version, parts.worker, parts.seq)

    def learner_prefix(self, step: int) -> str:
        return f"{self.root}learner/ckpt-{_number(step, MAX_STEP, 'step'):06d}/"

    def learner_file(self, step: int, name: str) -> str:
        return self.learner_prefix(step) + _relative_path(name, "file name")

    def latest_learner(self) -> str:
        """`learner/LATEST.json`: points at the newest complete learner checkpoint."""
        return f"{self.root}learner/LATEST.json"

    def eval_table(self, version: int) -> str:
        return f"{self.root}eval/{version_dir(version)}.parquet"

    def eval_summary(self, version: int) -> str:
        return f"{self.root}eval/{version_dir(version)}.json"

    def metrics(self, stage: str, name: str) -> str:
        return f"{self.root}metrics/{_name(stage, 'stage')}/{_name(name, 'metrics name')}.parquet"

    def metrics_chunk(self, stage: str, worker: int, time_us: int) -> str:
        """The bucketed chunk that worker `worker` of `stage` writes at `time_us` (microseconds
        since the epoch): `metrics/<stage>/w<WW>/<time_us // METRICS_BUCKET_US>/<time_us>.parquet`.
        A writer's chunks are contiguous in key order and sort by time."""
        t = _number(time_us, MAX_TIME_US, "time_us")
        return (f"{self.root}metrics/{_name(stage, 'stage')}/"
                f"w{_number(worker, MAX_WORKER, 'worker'):02d}/"
                f"{t // METRICS_BUCKET_US:07d}/{t:016d}.parquet")

    def state(self, stage: str, name: str) -> str:
        return f"{self.root}state/{_name(stage, 'stage')}/{_relative_path(name, 'state name')}"

    # -- the control plane's records (see `store.records`) -----------------------------------
    def progress(self) -> str:
        """`state/learn/progress.json`: the learner's commit point (`Progress`)."""
        return self.state("learn", "progress.json")

    def buffered(self) -> str:
        """`state/learn/buffered.json`: groups read but not committed (`Buffered`)."""
        return self.state("learn", "buffered.json")

    def taken(self) -> str:
        """`state/learn/taken.json`: groups taken into steps, as each starts (`Taken`)."""
        return self.state("learn", "taken.json")

    def ledger(self, commit: int) -> str:
        """`state/learn/ledger-<commit>.json`: one commit's shards (`LedgerDelta`)."""
        return self.state("learn", f"ledger-{_number(commit, MAX_STEP, 'commit'):06d}.json")

    def ledger_prefix(self) -> str:
        """The prefix every ledger delta of the run starts with."""
        return self.state("learn", "ledger-")

    def cursor(self, stage: str) -> str:
        """`state/<stage>/cursor.json`: the stage's lowest open version (`Cursor`)."""
        return self.state(stage, "cursor.json")

    def worker_state(self, worker: int) -> str:
        """`state/rollout/w<WW>.json`: a rollout worker's reservation (`WorkerState`)."""
        return self.state("rollout", f"w{_number(worker, MAX_WORKER, 'worker'):02d}.json")

    def passrate_snapshot(self, n: int) -> str:
        """`state/prepare/passrate-<n>.json`: the pass-rate history (`PassRateSnapshot`)."""
        return self.state("prepare", f"passrate-{_number(n, MAX_SEQ, 'snapshot'):06d}.json")

    def retired_prefix(self) -> str:
        return self.state("prepare", "retired") + "/"

    def retired_change(self, n: int) -> str:
        """`state/prepare/retired/<n>.json`: the n-th change of the retired prompts
        (`RetiredChange`); numbered in key order."""
        return self.retired_prefix() + f"{_number(n, MAX_COUNT, 'change'):09d}.json"

    def eval_confirm(self, suffix: str = "json") -> str:
        """`state/evaluate/confirm.json` (and `.parquet`): the chosen version evaluated again
        on fresh samples (`evaluate.confirm_choice`)."""
        return self.state("evaluate", f"confirm.{suffix}")

    def eval_latest(self) -> str:
        """`state/evaluate/latest.json`: the newest evaluated version (`EvalPointer`)."""
        return self.state("evaluate", "latest.json")

    def replay_source(self) -> str:
        """`state/replay/source.json`: what a replay run re-ran (`ReplaySource`)."""
        return self.state("replay", "source.json")

    def replay_check(self) -> str:
        """`state/replay/verify.json`: a replay's bit-for-bit comparison (`ReplayCheck`)."""
        return self.state("replay", "verify.json")

    def quarantine(self, stage: str, key: str) -> str:
        """Where the run's object `key` goes when `stage` cannot use it."""
        return f"{self.root}quarantine/{_name(stage, 'stage')}/{self.relative(key)}"

    def quarantine_prefix(self) -> str:
        return f"{self.root}quarantine/"

    def unquarantined(self, key: str) -> tuple[str, str]:
        """(stage, original key) of a key `quarantine` made; ValueError for any other key."""
        rest = key.removeprefix(self.quarantine_prefix())
        stage, _, relative = rest.partition("/")
        if rest == key or not relative:
            raise ValueError(f"key {key!r} is not under {self.quarantine_prefix()}<stage>/")
        return _name(stage, "stage"), self.root + relative


_WRITER = re.compile(r"runs/[^/]+/metrics/(?P<stage>[^/]+)/(?P<writer>w\d+(?=[-/])|[^/]+)")


def metrics_writer(key: str) -> str:
    """`<stage>/w<WW>` of a metrics chunk key, flat (`.../metrics/learn/w00-<time>.parquet`) or
    bucketed (`.../metrics/learn/w00/<bucket>/<time>.parquet`); the chunk's name when it names
    no worker. ValueError for a key outside a run's `metrics/<stage>/`."""
    m = _WRITER.match(key) if isinstance(key, str) else None
    if m is None:
        raise ValueError(
            f"not a metrics chunk key: {key!r} (expected runs/<run>/metrics/<stage>/...)")
    return f"{m['stage']}/{m['writer'].removesuffix('.parquet')}"


def quarantine_key(key: str, stage: str) -> str:
    """Quarantine location of any key: inside its run when it has one, else at the root."""
    m = re.match(r"runs/([^/]+)/", key)
    if m and len(key) > m.end():
        return RunKeys(m[1]).quarantine(stage, key)
    return f"quarantine/{_name(stage, 'stage')}/{key}"


def error_key(quarantined_key: str) -> str:
    """The `.error.json` written beside a quarantined object."""
    return f"{quarantined_key}.error.json"
