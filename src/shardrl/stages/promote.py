"""promote: register the chosen evaluated checkpoint and move the registry aliases."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from ..store.records import Aborted
from ..tracking.mlflow_run import RUN_TAG, client, find_or_create_run
from ..tracking.registry import POLICY_VERSION_TAG, find_version, log_policy
from . import EXIT_RUN_ABORTED
from .context import StageContext
from .evaluate import NOT_FIGURES
from .evaluate import summaries as evaluated
from .policy import WEIGHTS, download_folder, fetch_weights
from .retention import ranking

SETUP_TAG = "shardrl.eval_setup"
"""A registered version's evaluation setup (`evaluate.eval_setup`): what its metric was
measured on, besides the policy."""
FIGURE_TAG = "shardrl.eval_figure"
"""How a registered version's `eval.<metric>` was had: `confirmed` (a confirming evaluation of
the chosen version), `single` (its one evaluation, not chosen among others: `promote.choose:
last`) or `selected` (the best of the run's evaluations, which reads high; a version without
the tag too). `eval.selected.<metric>` holds the figure it was chosen on."""
UNBIASED = ("confirmed", "single")


def choose(summaries: dict[int, dict], metric: str, how: str) -> int:
    """The version to register: the best by `metric` (latest among equals) or the last."""
    if how == "last":
        return max(summaries)
    return max(summaries, key=lambda v: ranking(summaries[v][metric], v))


def main(ctx: StageContext) -> int:
    cfg = ctx.cfg
    if (marker := Aborted.read(ctx.store, ctx.keys.aborted(), optional=True)) is not None:
        ctx.log.error("the run was aborted (%s): nothing promoted from an unfinished run; "
                      "resume it once the cause is fixed", marker.describe())
        return EXIT_RUN_ABORTED
    if not ctx.store.exists(ctx.keys.done()):
        ctx.log.error("the learner has not finished this run (no %s): nothing promoted from "
                      "an unfinished run", ctx.keys.done())
        return 1
    summaries = evaluated(ctx.store, ctx.keys)
    if not summaries:
        ctx.log.error("no evaluated version to promote: did the evaluate stage run?")
        return 1
    version = choose(summaries, cfg.promote.metric, cfg.promote.choose)
    summary = summaries[version]
    result = {"version": version, "metric": cfg.promote.metric,
              "baseline": summaries.get(0, {}).get(cfg.promote.metric)}
    selected = float(summary[cfg.promote.metric])
    confirmed = confirmation(ctx, version, summary)
    if confirmed is not None:  # the best of several evaluations, measured again unbiased
        result["selected_value"] = selected
        summary, figure = confirmed, "confirmed"
    else:
        figure = "single" if cfg.promote.choose == "last" or len(summaries) == 1 else "selected"
    metric = float(summary[cfg.promote.metric])
    result["value"] = metric
    if (se := summary.get(f"{cfg.promote.metric}_se")) is not None:
        result["value_se"] = float(se)
    if cfg.tracking.enabled:
        result.update(register(ctx, version, metric, summary, selected, figure))
    ctx.store.put_json(ctx.keys.state("promote", "result.json"), result)
    ctx.log.info("promote: %s", result)
    return 0


def confirmation(ctx: StageContext, version: int, summary: dict) -> dict | None:
    """The confirming evaluation of the chosen `version` (`evaluate.confirm_choice`), when
    there is one of it, measured as its own evaluation was; else None (promote takes the last
    version, sampling is greedy, or the run predates it), and the version's own figures
    count."""
    key = ctx.keys.eval_confirm()
    confirmed = ctx.store.get_json(key) if ctx.store.exists(key) else None
    if confirmed is None or confirmed.get("version") != version:
        return None
    if confirmed.get("setup") != summary.get("setup"):
        ctx.log.warning("promote: the confirming evaluation of v%d was measured another way "
                        "than its own (setup %s against %s): not used", version,
                        confirmed.get("setup"), summary.get("setup"))
        return None
    return confirmed


def _assemble(ctx: StageContext, version: int, folder: Path) -> Path:
    download_folder(ctx.store, ctx.keys.policy_prefix(0), folder)
    if version != 0:
        save_file(fetch_weights(ctx.store, ctx.keys, version), str(folder / WEIGHTS))
    (folder / "MANIFEST.json").unlink(missing_ok=True)
    return folder


def register(ctx: StageContext, version: int, metric: float, summary: dict,
             selected: float, figure: str) -> dict:
    """Register policy `version` (once per run and version: a retry reuses the version an
    earlier attempt registered) and move the aliases: `challenger` to it unless a later
    registration holds it already, `champion` when it beats the champion's metric measured
    the same way (the same held-out items, sampling and scoring: `SETUP_TAG`). `figure`:
    how `metric` was had (`FIGURE_TAG`); `selected`: the figure the version was chosen on.
    Two unbiased figures (confirmed, or single) compare; otherwise the figures each side
    was chosen on do (a single evaluation's is itself), so a best-of-N figure never meets a
    confirmed one."""
    cfg = ctx.cfg
    name, margin = cfg.promote.model_name, cfg.promote.margin
    key, chosen_key = f"eval.{cfg.promote.metric}", f"eval.selected.{cfg.promote.metric}"
    c = client(cfg)
    run = find_or_create_run(cfg, ctx.run_id, c)
    if _found(lambda: c.get_registered_model(name)) is None:
        c.create_registered_model(name, description="ShardRL policies")
    mv = find_version(c, name, ctx.run_id, version)
    if mv is None:
        tags = {RUN_TAG: ctx.run_id, POLICY_VERSION_TAG: str(version),
                "shardrl.config_hash": cfg.config_hash(), key: str(metric)}
        tags.update({f"eval.{k}": str(v) for k, v in summary.items()
                     if isinstance(v, float) and k not in NOT_FIGURES})
        tags[FIGURE_TAG] = figure
        tags[chosen_key] = str(selected)
        if summary.get("setup"):
            tags[SETUP_TAG] = summary["setup"]
        with tempfile.TemporaryDirectory() as tmp:
            folder = _assemble(ctx, version, Path(tmp) / "model")
            info = log_policy(c, c.get_run(run).info.experiment_id, run, folder,
                              f"policy-v{version:06d}", tags)
        mv = c.create_model_version(name, source=info.model_uri, run_id=run, tags=tags,
                                    model_id=info.model_id)
    else:
        ctx.log.info("promote: %s version %s already holds policy v%d of this run; reusing it",
                     name, mv.version, version)
    challenger = _alias(c, name, "challenger")
    if challenger is None or int(challenger.version) <= int(mv.version):
        c.set_registered_model_alias(name, "challenger", mv.version)
    else:  # a retry or a resume, after a later registration took the alias: it stays there
        ctx.log.info("promote: challenger stays at %s version %s, registered after this one",
                     name, challenger.version)
    champion = _alias(c, name, "champion")
    promoted, kept = False, None
    held, mine, read = None, metric, key
    if champion is not None:
        theirs_unbiased = champion.tags.get(FIGURE_TAG) in UNBIASED
        if not (theirs_unbiased and figure in UNBIASED):
            # both sides' figures as chosen (an untagged champion's is its eval.<metric>)
            read, mine = (chosen_key if theirs_unbiased else key), selected
        held = _number(champion.tags.get(read))
    # a champion registered before setups were recorded compares on its metric alone
    theirs = None if champion is None else champion.tags.get(SETUP_TAG)
    ours = summary.get("setup")
    if champion is not None and champion.version == mv.version:
        promoted = True  # an earlier attempt made it champion
    elif champion is not None and held is None:
        # set by hand, or promoted on another metric: nothing to compare with, and replacing
        # a model someone chose unseen is worse than asking them
        kept = (f"champion {name} version {champion.version} has no numeric "
                f"{read} tag to compare with; it stays champion. Compare it with challenger version "
                f"{mv.version} and move the alias by hand, or tag it {read}=VALUE for "
                "later runs to compare")
        ctx.log.warning("promote: %s", kept)
    elif theirs is not None and ours is not None and theirs != ours:
        # another task, held-out set or sampling: the numbers do not measure the same thing
        kept = (f"champion {name} version {champion.version} was evaluated on other held-out "
                f"items or with other sampling or scoring ({SETUP_TAG} {theirs}, this "
                f"run's {ours}): its eval.{cfg.promote.metric} does not compare with "
                f"this run's; it stays champion. Give each task its own promote.model_name, "
                f"or move the alias by hand")
        ctx.log.warning("promote: %s", kept)
    elif champion is None or mine > held + margin:
        if champion is not None:
            c.set_registered_model_alias(name, "previous-champion", champion.version)
        c.set_registered_model_alias(name, "champion", mv.version)
        promoted = True
    if champion is not None and held is not None and not kept and champion.version != mv.version:
        # both figures measured the same way: say when their difference is within the noise
        # only two unbiased figures: a best-of-several one reads high by more than its error
        same = figure in UNBIASED and champion.tags.get(FIGURE_TAG) in UNBIASED
        ours_se = summary.get(f"{cfg.promote.metric}_se") if same else None
        theirs_se = _number(champion.tags.get(f"{key}_se")) if same else None
        if ours_se is not None and theirs_se is not None \
                and abs(mine - held) <= math.hypot(ours_se, theirs_se):
            ctx.log.warning(
                "promote: %s %.3f (± %.3f) against champion version %s's %.3f (± %.3f): the "
                "difference is within one standard error of it, so %s; promote.margin (now "
                "%g) moves the champion only on a larger win", read, mine, ours_se,
                champion.version, held, theirs_se,
                "the move is not a clear win" if promoted else "keeping the champion is not a "
                "clear loss either", margin)
    c.set_tag(run, "shardrl.registered_version", mv.version)
    return {"model_name": name, "model_version": mv.version, "champion": promoted,
            "mlflow_run_id": run, "source": mv.source, **({"champion_kept": kept} if kept else {})}


def _number(tag: str | None) -> float | None:
    """A metric tag's value; None when there is none or it is not a finite number (no
    challenger could beat a champion tagged `nan`, and it would stay so without a word)."""
    try:
        value = float(tag) if tag is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


MISSING = ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE")
"""How the registry says a model or an alias does not exist (a server, the SQLite store)."""


def _found(get):
    """`get()`, or None when the registry has no such thing; any other registry error (a
    server error, a locked database) is raised, not read as 'no champion', which would
    promote the challenger unchallenged."""
    from mlflow.exceptions import MlflowException

    try:
        return get()
    except MlflowException as exc:
        if exc.error_code in MISSING:
            return None
        raise


def _alias(c, name: str, alias: str):
    return _found(lambda: c.get_model_version_by_alias(name, alias))
