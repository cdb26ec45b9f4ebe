"""Run a compiled pipeline (KFP IR YAML) on this machine, the way Kubeflow would run it.

    python -m pipelines.emulate build/pipelines/shardrl.yaml --store runs \\
        [--param config=@my-run.yaml] [--secrets secrets.yaml] [--job-uuid UUID]

This tests the artifact we ship, not the Python that built it: everything comes from the
compiled YAML. The root parameters (their defaults, then `--param NAME=VALUE`, a value `@FILE`
read from FILE; `--store DIR` sets `store`); the DAG with its dependencies, ParallelFor loops
(items and parallelism limit) and nested DAGs; each executor's image, command and args with
KFP's placeholders resolved (`{{$.inputs.parameters['x']}}`, `{{$.pipeline_job_uuid}}`, output
paths, the executor input `{{$}}`); the container's `env` and, from the kfp-kubernetes platform spec, the Secrets mapped
to environment variables (their values from `--secrets`, a YAML file of `{secret: {key:
value}}`; a missing non-optional secret fails the task as Kubernetes would not start it) and
`activeDeadlineSeconds`; each task's retry policy (count, backoff duration and factor, and the
retry window measured from the task's first start, as Argo does).

Each task attempt runs as a process group of its own (a pod), in an empty folder that is its
working directory and HOME, with no environment but what KFP would give the container, and
this interpreter's bin folder standing in for the image. When a task's main process exits,
whatever it left running is killed, as when a container ends. When a task fails for good no
new task starts (Argo's fail-fast DAGs); running ones are waited for, and the run fails.

Not emulated: images (every task runs in this environment; the image is logged), resources,
scheduling, caching, conditions and task outputs consumed by other tasks. A task's
executor output file, when it writes one, must parse as KFP's `ExecutorOutput`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

_PLACEHOLDER = re.compile(r"\{\{\$(?:\.([^}]*))?\}\}")
_INPUT = re.compile(r"inputs\.parameters\['([^']+)'\]\Z")
_OUTPUT = re.compile(r"outputs\.(artifacts|parameters)\['([^']+)'\]\.(path|uri|output_file)\Z")


class EmulationError(RuntimeError):
    """The compiled pipeline uses something this executor does not emulate, or is invalid."""


def output_path(outputs: Path, kind: str, name: str) -> Path:
    """Where a task writes output `name` ("artifacts" or "parameters")."""
    path = outputs / kind / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def executor_input(component: dict, inputs: dict, outputs: Path) -> dict:
    """KFP's `ExecutorInput` (the `{{$}}` placeholder): the input parameter values, each
    output artifact's URI and the file the task writes its `ExecutorOutput` to."""
    defs = component.get("outputDefinitions", {})
    artifacts = {name: {"artifacts": [{
        "name": name, "type": d.get("artifactType", {}),
        "uri": output_path(outputs, "artifacts", name).as_uri(), "metadata": {}}]}
        for name, d in defs.get("artifacts", {}).items()}
    parameters = {name: {"outputFile": str(output_path(outputs, "parameters", name))}
                  for name in defs.get("parameters", {})}
    return {"inputs": {"parameterValues": inputs},
            "outputs": {"artifacts": artifacts, "parameters": parameters,
                        "outputFile": str(outputs / "executor_output.json")}}


def check_executor_output(path: Path) -> str | None:
    """Why the `ExecutorOutput` a task wrote is not one KFP can read (None if it is, or the
    task wrote none)."""
    if not path.exists():
        return None
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    try:
        json_format.Parse(path.read_text(), pipeline_spec_pb2.ExecutorOutput())
    except json_format.ParseError as exc:
        return f"{path} is not a valid ExecutorOutput: {exc}"
    return None


def seconds(duration: str | None) -> float | None:
    """`"30s"` (protobuf Duration JSON) -> 30.0."""
    return None if duration is None else float(str(duration).rstrip("s"))


@dataclass(frozen=True)
class Retry:
    """A task's retry policy as the IR states it."""

    count: int = 0
    backoff_s: float = 0.0
    factor: float = 2.0
    window_s: float | None = None
    """Longest time from the first attempt's start within which a retry may start."""

    @classmethod
    def of(cls, task: dict) -> Retry:
        policy = task.get("retryPolicy") or {}
        return cls(int(policy.get("maxRetryCount", 0)),
                   seconds(policy.get("backoffDuration")) or 0.0,
                   float(policy.get("backoffFactor", 2.0)),
                   seconds(policy.get("backoffMaxDuration")))

    def delay(self, retry: int) -> float:
        """Seconds before retry number `retry` (0-based)."""
        return self.backoff_s * self.factor ** retry


def typed(value: str, kind: str):
    """A parameter value given as text, converted to the IR's parameter type."""
    if kind == "NUMBER_INTEGER":
        return int(value)
    if kind == "NUMBER_DOUBLE":
        return float(value)
    if kind == "BOOLEAN":
        return value.lower() in ("1", "true", "yes")
    if kind in ("LIST", "STRUCT"):
        return json.loads(value)
    return value


def text(value) -> str:
    """A parameter value as a placeholder renders it on a command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


class Emulator:
    """One run of a compiled pipeline."""

    def __init__(self, path: Path, params: dict[str, str], secrets: dict[str, dict[str, str]],
                 work_dir: Path, job_uuid: str) -> None:
        docs = list(yaml.safe_load_all(path.read_text()))
        self.spec = docs[0]
        platform = docs[1] if len(docs) > 1 and docs[1] else {}
        self.k8s = (platform.get("platforms", {}).get("kubernetes", {})
                    .get("deploymentSpec", {}).get("executors", {}))
        self.executors = self.spec["deploymentSpec"]["executors"]
        self.secrets, self.work_dir, self.job_uuid = secrets, work_dir, job_uuid
        self.name = self.spec["pipelineInfo"]["name"]
        self.params = self._root_params(params)
        self.lock = threading.Lock()
        self.failed = threading.Event()
        """Set when any task failed for good: no new task starts anywhere (fail fast)."""
        self.stopped = threading.Event()
        self.running: dict[int, str] = {}
        """pid -> task path of the attempts running now."""
        self.started = time.monotonic()
        self.error: EmulationError | None = None
        """The first thing the run needed that is not emulated (the run fails with it)."""

    def _root_params(self, given: dict[str, str]) -> dict:
        defs = self.spec["root"].get("inputDefinitions", {}).get("parameters", {})
        unknown = set(given) - set(defs)
        if unknown:
            raise EmulationError(f"unknown parameter(s) {sorted(unknown)}; the pipeline has "
                                 f"{sorted(defs)}")
        params = {}
        for name, d in defs.items():
            if name in given:
                params[name] = typed(given[name], d.get("parameterType", "STRING"))
            elif "defaultValue" in d:
                params[name] = d["defaultValue"]
            elif not d.get("isOptional"):
                raise EmulationError(f"parameter '{name}' has no default: give --param {name}=...")
        return params

    def say(self, message: str) -> None:
        with self.lock:
            print(f"[{time.monotonic() - self.started:7.1f}s] {message}", flush=True)

    # -- placeholders ---------------------------------------------------------------------
    def render(self, value: str, inputs: dict, task_path: str, outputs: Path | None,
               component: dict | None = None) -> str:
        def one(m: re.Match) -> str:
            name = m.group(1)
            if name is None and outputs is not None and component is not None:
                return json.dumps(executor_input(component, inputs, outputs))
            if name == "pipeline_job_uuid":
                return self.job_uuid
            if name == "pipeline_job_name":
                return f"{self.name}-{self.job_uuid[:8]}"
            if name == "pipeline_task_name":
                return task_path.rsplit("/", 1)[-1]
            if name is not None and (i := _INPUT.match(name)):
                if i[1] not in inputs:
                    raise EmulationError(f"{task_path}: no input parameter '{i[1]}'")
                return text(inputs[i[1]])
            if name is not None and (o := _OUTPUT.match(name)) and outputs is not None:
                path = output_path(outputs, o[1], o[2])
                return path.as_uri() if o[3] == "uri" else str(path)
            raise EmulationError(f"{task_path}: placeholder {m.group(0)} is not emulated")

        return _PLACEHOLDER.sub(one, value)

    def task_inputs(self, task: dict, scope: dict, path: str) -> dict:
        """The values of a task's input parameters, from its DAG's inputs and constants."""
        values = {}
        for name, source in task.get("inputs", {}).get("parameters", {}).items():
            if "componentInputParameter" in source:
                values[name] = scope[source["componentInputParameter"]]
            elif "runtimeValue" in source:
                constant = source["runtimeValue"]["constant"]
                values[name] = (self.render(constant, scope, path, None)
                                if isinstance(constant, str) else constant)
            else:
                raise EmulationError(f"{path}: input '{name}' from {sorted(source)} is not "
                                     "emulated")
        if task.get("inputs", {}).get("artifacts"):
            raise EmulationError(f"{path}: input artifacts are not emulated")
        return values

    # -- the DAG --------------------------------------------------------------------------
    def run(self) -> bool:
        return self.dag(self.spec["root"]["dag"], self.params, self.name)

    def dag(self, dag: dict, scope: dict, path: str) -> bool:
        """Run a DAG's tasks as their dependencies allow; whether all of them succeeded."""
        tasks = dag["tasks"]
        state: dict[str, bool | None] = {}
        """task -> None (running), True (succeeded), False (failed or skipped)."""
        done = threading.Condition()

        def finish(name: str, ok: bool) -> None:
            with done:
                state[name] = ok
                done.notify_all()

        def start(name: str) -> None:
            task = tasks[name]
            state[name] = None
            label = f"{path}/{task.get('taskInfo', {}).get('name', name)}"
            threading.Thread(target=lambda: finish(name, self.guarded(task, scope, label)),
                             daemon=True).start()

        with done:
            while True:
                for name, task in tasks.items():
                    if name in state:
                        continue
                    deps = task.get("dependentTasks", [])
                    if any(state.get(d) is False for d in deps):
                        state[name] = False  # skipped: an upstream task failed
                    elif all(state.get(d) is True for d in deps) and not self.failed.is_set():
                        if "triggerPolicy" in task:
                            raise EmulationError(f"{path}/{name}: conditions and exit "
                                                 "handlers are not emulated")
                        start(name)
                running = [n for n, s in state.items() if s is None]
                if not running and (len(state) == len(tasks) or self.failed.is_set()):
                    return len(state) == len(tasks) and all(state.values())
                done.wait()

    def guarded(self, task: dict, scope: dict, path: str) -> bool:
        """`task` on a thread of its own: an emulation error fails the run."""
        try:
            return self.task(task, scope, path)
        except EmulationError as exc:
            self.error = self.error or exc
            self.failed.set()
            return False

    def task(self, task: dict, scope: dict, path: str) -> bool:
        component = self.spec["components"][task["componentRef"]["name"]]
        inputs = self.task_inputs(task, scope, path)
        if "dag" in component:
            if "parameterIterator" in task:
                return self.loop(task, component["dag"], inputs, path)
            return self.dag(component["dag"], inputs, path)
        return self.container(task, component["executorLabel"], inputs, path)

    def loop(self, task: dict, dag: dict, inputs: dict, path: str) -> bool:
        """A ParallelFor: the body once per item, at most `parallelismLimit` at a time."""
        iterator = task["parameterIterator"]
        items = iterator["items"]
        if "raw" in items:
            values = json.loads(items["raw"])
        else:
            values = inputs[items["inputParameter"]]
            values = json.loads(values) if isinstance(values, str) else values
        limit = int(task.get("iteratorPolicy", {}).get("parallelismLimit", 0)) or len(values)
        slots = threading.Semaphore(limit)
        results: list[bool] = []
        threads = []

        def body(i: int, value) -> None:
            try:
                scope = {**inputs, iterator["itemInput"]: value}
                try:
                    results.append(self.dag(dag, scope, f"{path}[{i}]"))
                except EmulationError as exc:
                    self.error = self.error or exc
                    self.failed.set()
                    results.append(False)
            finally:
                slots.release()

        for i, value in enumerate(values):
            slots.acquire()
            if self.failed.is_set():
                slots.release()
                results.append(False)
                break
            t = threading.Thread(target=body, args=(i, value), daemon=True)
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        return all(results) and len(results) == len(values)

    # -- one container task ---------------------------------------------------------------
    def environment(self, label: str, container: dict, home: Path, path: str) -> dict[str, str]:
        """What the container's processes see: a bare base, the container's env, Secrets."""
        env = {"PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin",
                                        "/usr/bin", "/bin"]),
               "HOME": str(home), "LANG": "C.UTF-8", "HOSTNAME": home.name}
        for item in container.get("env", []):
            env[item["name"]] = item.get("value", "")
        for mapping in self.k8s.get(label, {}).get("secretAsEnv", []):
            name = mapping.get("secretName") or (mapping.get("secretNameParameter", {})
                                                 .get("runtimeValue", {}).get("constant"))
            secret = self.secrets.get(name)
            for key in mapping.get("keyToEnv", []):
                if secret is not None and key["secretKey"] in secret:
                    env[key["envVar"]] = str(secret[key["secretKey"]])
                elif not mapping.get("optional"):
                    raise EmulationError(f"{path}: secret '{name}' (key '{key['secretKey']}') "
                                         "is missing; Kubernetes would not start the pod")
        return env

    def container(self, task: dict, label: str, inputs: dict, path: str) -> bool:
        container = self.executors[label]["container"]
        component = self.spec["components"][task["componentRef"]["name"]]
        retry = Retry.of(task)
        deadline = self.k8s.get(label, {}).get("activeDeadlineSeconds")
        first_start = time.monotonic()
        for attempt in range(retry.count + 1):
            if attempt:
                delay = retry.delay(attempt - 1)
                if (retry.window_s is not None
                        and time.monotonic() + delay - first_start > retry.window_s):
                    self.say(f"{path}: retry window of {retry.window_s:g} s is over")
                    break
                self.say(f"{path}: retrying in {delay:g} s ({attempt}/{retry.count})")
                if self.stopped.wait(delay):
                    break
            if self.stopped.is_set():
                break
            if self.attempt(container, component, label, inputs, path, attempt,
                            float(deadline) if deadline else None):
                return True
        self.failed.set()
        self.say(f"{path}: FAILED")
        return False

    def attempt(self, container: dict, component: dict, label: str, inputs: dict, path: str,
                attempt: int, deadline_s: float | None) -> bool:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "_", path)
        pod = self.work_dir / "pods" / f"{slug}.{attempt}"
        pod.mkdir(parents=True)
        outputs = self.work_dir / "outputs" / slug
        argv = [self.render(a, inputs, path, outputs, component)
                for a in [*container.get("command", []), *container.get("args", [])]]
        env = self.environment(label, container, pod, path)
        log = self.work_dir / "logs" / f"{slug}.{attempt}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as handle:
            proc = subprocess.Popen(argv, cwd=pod, env=env, stdout=handle,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        with self.lock:
            self.running[proc.pid] = path
        shown = " ".join(a if len(a) <= 40 and "\n" not in a else "<...>" for a in argv)
        self.say(f"{path}: started (attempt {attempt + 1}, pid {proc.pid}, image "
                 f"{container.get('image')}): {shown}")
        try:
            code = proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            self.say(f"{path}: past activeDeadlineSeconds = {deadline_s:g}: killed")
            code = None
        finally:
            with self.lock:
                self.running.pop(proc.pid, None)
            with_group(proc.pid, signal.SIGKILL)  # the container ends with its main process
            proc.wait()
        if code == 0 and (problem := check_executor_output(outputs / "executor_output.json")):
            self.say(f"{path}: {problem}")
            return False
        if code == 0:
            self.say(f"{path}: succeeded")
            return True
        tail = log.read_text(errors="replace").splitlines()[-15:]
        self.say(f"{path}: exited with {code} (log {log})\n    " + "\n    ".join(tail))
        return False

    def stop(self) -> None:
        """Kill every running task (the emulator was interrupted)."""
        self.stopped.set()
        self.failed.set()
        with self.lock:
            pids = list(self.running)
        for pid in pids:
            with_group(pid, signal.SIGKILL)


def with_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def parse_params(items: list[str]) -> dict[str, str]:
    params = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--param {item!r}: expected NAME=VALUE")
        params[name] = Path(value[1:]).read_text() if value.startswith("@") else value
    return params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipelines.emulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("compiled", help="compiled pipeline YAML (python -m pipelines.shardrl)")
    parser.add_argument("--store", help="sets the `store` parameter (a folder here)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a pipeline parameter; a value @FILE is read from FILE")
    parser.add_argument("--secrets", help="YAML file {secret name: {key: value}}")
    parser.add_argument("--job-uuid", default=None, help="the run's uuid (default: random)")
    parser.add_argument("--work-dir", default=None,
                        help="pods' folders, logs and outputs (default: .emulate/<job uuid>)")
    args = parser.parse_args(argv)
    params = parse_params(args.param)
    if args.store:
        params["store"] = str(Path(args.store).resolve()) if "://" not in args.store else args.store
    secrets = yaml.safe_load(Path(args.secrets).read_text()) if args.secrets else {}
    job_uuid = args.job_uuid or str(uuid.uuid4())
    work_dir = Path(args.work_dir or Path(".emulate") / job_uuid).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        emulator = Emulator(Path(args.compiled), params, secrets or {}, work_dir, job_uuid)
    except EmulationError as exc:
        print(f"emulate: {exc}", file=sys.stderr)
        return 2

    def interrupted(signum, frame):  # noqa: ARG001 - a signal handler's signature
        emulator.stop()

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    emulator.say(f"run {job_uuid} of {emulator.name}: work dir {work_dir}")
    try:
        ok = emulator.run()
    except EmulationError as exc:
        emulator.error = exc
    if emulator.error is not None:
        emulator.stop()
        print(f"emulate: {emulator.error}", file=sys.stderr)
        return 2
    emulator.say(f"run {job_uuid}: {'SUCCEEDED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
