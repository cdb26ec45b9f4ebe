"""`shardrl replay RUN_ID [--to-version N] [--verify] [--store URI] [--set KEY=VALUE ...]`.

Re-runs the learner of a run from its ledger into a new run (see `stages.learn.replay`):
`--verify` checks that it publishes the same weights bit for bit; `--set algo...` tries a
change of the loss on exactly the same shards, as a run `shardrl report` reads like any other
(its versions are evaluated unless `--no-eval`).
"""

from __future__ import annotations

import sys
import time

EXIT_DIFFERENT = 3
"""Exit status of `--verify` when the replay's weights differ from the run's, and of a replay
without `--set` that departed from the run's record (another KL coefficient, an update
applied where the run's was skipped, a restart's checkpoint it lacks)."""
EXIT_UNVERIFIED = 4
"""Exit status of `--verify` when the run kept no version to compare (retention deleted them):
nothing was shown equal."""


def spans(versions: list[int]) -> str:
    """`v1-v3, v5` for [1, 2, 3, 5]."""
    runs: list[list[int]] = []
    for v in versions:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"v{a}" if a == b else f"v{a}-v{b}" for a, b in runs)


def run(args) -> int:
    from ..config import ConfigError
    from ..config.loader import apply_overrides, validate
    from ..doctor.series import store_or_default
    from ..stages.context import setup_logging
    from ..stages.learn.replay import Replay, not_replayed
    from ..store import RunKeys, StoreError, open_store
    from ..store.keys import new_run_id
    from ..store.records import Progress, read_run_json

    try:
        source = RunKeys(args.run)
    except ValueError as exc:
        print(f"shardrl replay: {exc}", file=sys.stderr)
        return 2
    try:
        store = open_store(store_or_default(args.store))
        found = store.exists(source.run_json())
    except StoreError as exc:  # a bad URI, missing credentials or bucket, a store down
        print(f"shardrl replay: {exc}", file=sys.stderr)
        return 1
    if not found:
        print(f"shardrl replay: no run {args.run!r} in {store.uri}", file=sys.stderr)
        return 2
    if args.verify and args.overrides:
        print("shardrl replay: --verify checks an unchanged replay; drop --set or --verify",
              file=sys.stderr)
        return 2
    for item in args.overrides:
        if (why := not_replayed(item)) is not None:
            print(f"shardrl replay: --set {item}: a replay cannot change it: {why}",
                  file=sys.stderr)
            return 2
    setup_logging("replay", 0)  # once the run is found: the replay logs as a stage does
    try:
        run_json = read_run_json(store, source.run_json())
    except StoreError as exc:  # not JSON, or no config in it: one line
        print(f"shardrl replay: {exc}", file=sys.stderr)
        return 1
    data = as_recorded(run_json["config"])
    try:
        cfg = validate(apply_overrides(data, args.overrides), f"{args.run}/run.json")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    backend = cfg.learner.backend
    if backend.kind == "deepspeed" and backend.ranks > 1:
        print("shardrl replay: the run's learner had several DeepSpeed ranks; replay runs one "
              "process: add --set learner.backend.kind=torch (equal up to reduction order, "
              "not bit for bit)", file=sys.stderr)
        return 2
    last = Progress.read(store, source.progress()).version
    if last == 0:
        print(f"shardrl replay: run {args.run} has committed no version yet: nothing to replay",
              file=sys.stderr)
        return 2
    if args.to_version is not None and args.to_version > last:
        print(f"shardrl replay: --to-version {args.to_version} is past the run's last "
              f"committed version, {last}", file=sys.stderr)
        return 2
    target = args.run_id or new_run_id(f"{args.run}-replay")
    replay = Replay(store, args.run, target, cfg, tuple(args.overrides), args.to_version,
                    args.verify)
    started = time.monotonic()
    try:
        replay.start_run(run_json)
        check = replay.run()
    except BaseException as exc:
        removed = replay.remove_started()  # nothing half-written keeps the id taken
        if removed:
            print(f"shardrl replay: the replay failed; the {removed} objects of run {target} "
                  "it had written are removed", file=sys.stderr, flush=True)
        if isinstance(exc, ConfigError):  # a setting the learner refused: its fields, no trace
            print(exc, file=sys.stderr)
            return 1
        raise
    print(f"replay {target}: {args.run} re-learnt in {time.monotonic() - started:.1f} s",
          flush=True)
    for why in replay.departures if not args.verify else ():
        print(f"replay {target}: departed from {args.run}'s record at {why}", file=sys.stderr,
              flush=True)
    if args.overrides and not args.no_eval:
        started = time.monotonic()
        replay.evaluate()
        print(f"replay {target}: evaluated in {time.monotonic() - started:.1f} s", flush=True)
    if not args.verify:  # unchanged settings that departed: not the run's learner again
        return EXIT_DIFFERENT if replay.departures and not args.overrides else 0
    print(f"verify: compared {spans(check.checked) or 'no version'}"
          + (f"; deleted by retention: {spans(check.missing)}" if check.missing else ""))
    if check.divergence:
        print(f"verify: DIFFERENT: {check.divergence}")
    if (d := check.first_difference) is not None:
        diff = "" if d.max_abs_diff is None else f", max |diff| {d.max_abs_diff:.3g}"
        print(f"verify: DIFFERENT at step {d.version} (policy v{d.version}): tensor {d.tensor} "
              f"({d.elements} elements differ{diff})")
    if not check.ok:
        return EXIT_DIFFERENT
    if not check.checked:
        print("verify: NOT VERIFIED: the run kept none of the replayed versions to compare "
              "with (retention deleted them)")
        return EXIT_UNVERIFIED
    print(f"verify: bit-for-bit equal ({len(check.checked)} versions)")
    return 0


def as_recorded(config: dict) -> dict:
    """A recorded run config with the settings its run trained with where it predates them:
    a run recorded before `learner.share_prompts` existed computed every row whole."""
    learner = config.get("learner")
    if isinstance(learner, dict) and "share_prompts" not in learner:
        config = {**config, "learner": {**learner, "share_prompts": False}}
    return config
