"""Live progress of a local run, metric forwarding to MLflow, and the closing summary.

A tick costs the same late in a run as early on: it reads the learner's progress, the newest
evaluation named by `state/evaluate/latest.json`, and the metric chunks after the marks of
`state/runner/forwarded.json` (a `Forwarder`: one point per metric and step), never a whole
folder of the run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ..stages.evaluate import latest_evaluated, plus_minus, summaries
from ..store.records import Done, Progress
from ..tracking.mlflow_run import log_points, open_run, redacted, tracking_uri
from .accounting import account
from .forward import Forwarder, SendFailed, metric_writers, settle_lags


def refused(exc: BaseException | None) -> bool:
    """Whether MLflow refused a request for what it holds (a bad value), which no retry
    changes, rather than failing to answer."""
    code = getattr(exc, "error_code", None)
    return code in ("INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS")


RETRY_S = 30.0
"""Seconds between a tick's tries to forward metrics while MLflow fails to answer."""
BRIEF = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


@contextlib.contextmanager
def brief_requests() -> Iterator[None]:
    """MLflow's HTTP requests made inside: no retry and a 5 s timeout instead of its default
    minutes. Set in the runner's own environment for the call only: the stages it
    forks later (promote) keep MLflow's patient defaults."""
    saved = {k: os.environ.get(k) for k in BRIEF}
    os.environ.update(BRIEF)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Monitor:
    def __init__(self, lr, progress_bar: bool = True, brief_start: bool = False) -> None:
        """`brief_start`: the first contact with MLflow makes one short try (the local
        runner, which says in seconds that MLflow does not answer, before any stage starts);
        a Kubeflow task keeps MLflow's patient retries, as its pod is retried anyway."""
        self.lr = lr
        self.total = lr.cfg.learner.total_steps
        self.bar = None
        if progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            tqdm.monitor_interval = 0  # no monitor thread: the runner forks stages
            self.bar = tqdm(total=self.total, desc="learner", unit="step", file=sys.stderr)
        self.last_line = ""
        self.last_tick = 0.0
        self.forwarder = Forwarder(lr.store, lr.keys, metric_writers(lr.cfg),
                                   lambda points: log_points(self.client, self.mlflow, points),
                                   lags=settle_lags(lr.cfg))
        """Sends the metric chunks to MLflow, reduced per step; a resumed run forwards only
        what its predecessor had not."""
        self.forward_after = 0.0
        """No forwarding by a tick before this time (MLflow failed to answer the last)."""
        self.forward_failing = False
        self.last_eval: tuple[int, dict] | None = None
        """(version, summary) of the newest evaluation seen."""
        self.mlflow = None
        if lr.cfg.tracking.enabled:
            # the run's first contact with MLflow: one that does not answer is said within
            # seconds (MLflow's own retries took about four minutes), before any stage starts
            with brief_requests() if brief_start else contextlib.nullcontext():
                self.client, self.mlflow = open_run(lr.cfg, lr.run_id, new=lr.new)

    def say(self, text: str) -> None:
        (self.bar.write if self.bar else print)(text)
        sys.stdout.flush()

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last_tick < 3.0:
            return
        self.last_tick = now
        store, keys = self.lr.store, self.lr.keys
        progress = Progress.read(store, keys.progress())
        step = progress.version
        last_eval = self._last_eval()
        stale = progress.staleness
        line = (f"step {step}/{self.total}"
                + (f"  pass@1 v{last_eval[0]} {last_eval[1]['pass_at_1']:.3f}" if last_eval else "")
                + f"  consumed {progress.counts.get('consumed', 0)}"
                + (f"  staleness max {max(stale)}" if stale else ""))
        if self.bar:
            self.bar.n = step
            self.bar.set_postfix_str(line.split("  ", 1)[-1])
            self.bar.refresh()
        elif line != self.last_line:
            print(line, flush=True)
        self.last_line = line
        self._forward(patient=False)

    def _last_eval(self) -> tuple[int, dict] | None:
        """(version, summary) of the newest evaluation; its summary is read once."""
        store, keys = self.lr.store, self.lr.keys
        version = latest_evaluated(store, keys)
        if version is not None and (self.last_eval is None or self.last_eval[0] != version):
            self.last_eval = (version, store.get_json(keys.eval_summary(version)))
        return self.last_eval

    def _evals(self) -> dict[int, dict]:
        """Every evaluation summary by version (lists `eval/`: for the closing summary)."""
        return summaries(self.lr.store, self.lr.keys)

    def _forward(self, final: bool = False, patient: bool = True) -> None:
        """Send MLflow the settled steps of new metric chunks (every step when `final`): the
        runner is the only SQLite writer.

        MLflow down does not stop the run: the metrics stay in the store, a warning says so
        once, and they go once it answers (or with `--resume`). A tick (not `patient`) makes
        one short try, then none for `RETRY_S`: MLflow's own retries take minutes, which the
        runner's loop, restarting crashed stages and answering Ctrl-C, cannot wait."""
        if self.mlflow is None or (not patient and time.monotonic() < self.forward_after):
            return
        try:
            with contextlib.nullcontext() if patient else brief_requests():
                self.forwarder.forward(final)
        except SendFailed as exc:  # MLflow's failure alone: the store's are the run's
            self.forward_after = time.monotonic() + RETRY_S
            if refused(exc.__cause__):  # sent again, it would be refused again, for ever
                print(f"MLflow refused a batch of the run's metric points "
                      f"({redacted(str(exc))[:300]}): the points of that forward not yet "
                      "taken stay in the store only", file=sys.stderr, flush=True)
                self.forwarder.unsent = []
                self.forward_failing = False  # MLflow answers: nothing to try again
                return
            if not self.forward_failing:
                print(f"MLflow did not take the run's metrics ({redacted(str(exc))[:300]}): "
                      f"they stay in the store; trying again every {RETRY_S:.0f} s, and a "
                      "resumed run sends what is left", file=sys.stderr, flush=True)
            self.forward_failing = True
            return
        if self.forward_failing:
            print("MLflow takes the run's metrics again", file=sys.stderr, flush=True)
        self.forward_failing = False

    def finish_metrics(self, final: bool = True) -> None:
        """The last progress line and forward; `final` sends every step, settled or not (no
        writer will log more)."""
        self.last_tick = 0.0
        self.tick()
        self._forward(final=final)
        if self.bar:
            self.bar.close()
            self.bar = None

    def summary(self) -> int:
        lr = self.lr
        store, keys = lr.store, lr.keys
        self._forward(final=True)
        evals = self._evals()
        acc = account(store, keys)
        done = Done.read(store, keys.done())
        promo_key = keys.state("promote", "result.json")
        promo = store.get_json(promo_key) if store.exists(promo_key) else {}
        first, last = (evals.get(0), evals[max(evals)]) if evals else (None, None)
        print("\n== ShardRL run summary ==")
        print(f"run id            {lr.run_id}")
        converged = (f" of {self.total}: converged, every sample of its last prompt groups was "
                     "correct" if done.converged else "")
        print(f"learner steps     {done.steps}{converged}")
        if first and last:
            print(f"held-out pass@1   SFT baseline (v0) {first['pass_at_1']:.3f}"
                  f"{plus_minus(first, 'pass_at_1')} -> final (v{max(evals)}) "
                  f"{last['pass_at_1']:.3f}{plus_minus(last, 'pass_at_1')}  "
                  f"({first['prompts']} prompts, T={first['temperature']}"
                  f"{'; ± a standard error' if 'pass_at_1_se' in last else ''})")
        print(f"samples           {acc.line()}")
        print(f"staleness         {done.staleness} (version lag: samples admitted within "
              "the bound, those filtered after included)")
        # the chosen version's figure, confirmed on fresh samples when it was the best of
        # several (its own evaluation's, the selection, in brackets)
        se = plus_minus(promo, "value")  # its `value_se`
        figure = (f"{promo['metric']} {promo['value']:.3f}{se} confirmed on fresh samples "
                  f"({promo['selected_value']:.3f} when chosen)" if "selected_value" in promo
                  else f"{promo.get('metric')} {promo.get('value', float('nan')):.3f}{se}")
        if promo.get("model_version") is not None:
            print(f"registered model  {promo.get('model_name')} v{promo.get('model_version')} "
                  f"(policy v{promo['version']}, {figure}"
                  f"{', champion' if promo.get('champion') else ', challenger only'})")
            if promo.get("champion_kept"):
                print(f"                  {promo['champion_kept']}")
        elif promo:  # tracking off: chosen, but there is no registry to put it in
            print(f"chosen version    policy v{promo['version']} ({figure}; tracking is off, "
                  "so nothing was registered)")
        if lr.cfg.tracking.enabled:
            uri = redacted(tracking_uri(lr.cfg))
            print(f"MLflow            {uri}")
            ui = Path(sys.executable).parent / "mlflow"  # the environment's own, any folder
            print(f"                  open the UI: {ui} ui --backend-store-uri {uri}")
        print(f"logs              {lr.log_dir}")
        if self.forward_failing:  # the final forward too: MLflow lacks some of the metrics
            print("MLflow lacks some of the run's metrics (above): they are in the store, "
                  "and resuming the run sends them", file=sys.stderr, flush=True)
        if self.mlflow is not None and not self.forward_failing:
            summary = {f"summary/{k}": float(v) for k, v in acc.as_dict().items()
                       if isinstance(v, int | float)}
            if first and last:
                summary["summary/pass_at_1_baseline"] = first["pass_at_1"]
                summary["summary/pass_at_1_final"] = last["pass_at_1"]
            log_points(self.client, self.mlflow,
                       [(k, done.steps, v, time.time()) for k, v in summary.items()])
            self.client.set_terminated(self.mlflow)
        store.put_json(keys.state("runner", "summary.json"), {
            "accounting": acc.as_dict(), "evals": {str(k): v for k, v in evals.items()},
            "promote": promo, "done": done.model_dump(mode="json"),
            # False: MLflow lacks some metrics, which a resume of the run sends
            "mlflow_complete": None if self.mlflow is None else not self.forward_failing})
        # a run whose metrics MLflow lacks still succeeded (and a failing exit would lose a
        # Kubeflow report task's artifacts): the lines above say so
        return 0 if acc.balanced else 3

