"""The skeleton the benchmark pipelines (``pipelines/bench_*.py``) share: their flags, measurements
in fresh child processes (each with its own imports and peak memory), the process's memory and the
machine's load, the MLflow run they end with, and a config error as one line and exit status 2.
Written once here, a script keeps only what it measures and how it prints it.

Only the standard library (and the stdlib-only ``pfl.schema``) at module level: a measuring child
imports this before its clock starts; the MLflow tail imports ``pfl.runner`` only when it logs.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .schema import ConfigError

#: the hidden flag that makes a benchmark script measure one spec and print the result
CHILD_FLAG = "--child"
#: where the running ``pfl`` package lives: a child imports the same code its parent measures
ROOT = Path(__file__).resolve().parents[1]

Metrics = Mapping[str, float] | Iterable[tuple[Mapping[str, float], int | None]]


def parser(doc: str | None, experiment: bool = False) -> argparse.ArgumentParser:
    """The script's parser: its docstring as the help text, line breaks kept, and ``--no-track``
    (and ``--experiment`` where the script's run may go to another MLflow experiment)."""
    out = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    out.add_argument("--no-track", action="store_true", help="log no MLflow run")
    if experiment:
        out.add_argument("--experiment", default=None, help="the MLflow experiment (default: mlflow.yaml's)")
    return out


def run_json(cmd: Sequence[str], what: str, env: Mapping[str, str] | None = None) -> Any:
    """Run ``cmd``; the JSON on the last such line of its stdout (the rest: a library's chatter).
    A failed child raises with its exit status and its stderr's tail (the traceback that says why)."""
    proc = subprocess.run(list(cmd), capture_output=True, text=True, env=None if env is None else dict(env))
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    raise RuntimeError(f"{what} printed no JSON result:\n{proc.stdout[-1000:]}\n{proc.stderr[-2000:]}")


def run_child(script: str | Path, spec: Mapping[str, Any], what: str, env: Mapping[str, str] | None = None) -> Any:
    """``script`` run as ``python SCRIPT --child SPEC`` (its :func:`main` hands the spec to its
    child function), with this ``pfl`` first on the child's path; ``env``: more variables."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    full = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
    return run_json([sys.executable, str(script), CHILD_FLAG, json.dumps(dict(spec))], what, full)


def rss_mib(key: str = "VmRSS") -> float:
    """A line of ``/proc/self/status`` in MiB: the resident set now (``VmRSS``) or its peak since
    the last reset of ``/proc/self/clear_refs`` (``VmHWM``); nan where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def peak_rss_mib() -> float:
    """The process's peak resident set in MiB (``ru_maxrss``, KiB on Linux). A child's counts from
    its parent's size at the fork: measure in children of a process that stayed small."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def proc_cpu_and_rss(pids: Iterable[int]) -> tuple[float, float]:
    """CPU seconds (user + system) and resident MiB summed over other processes by pid, from
    /proc (a pool's workers, a simulation's actors); a process that is gone counts nothing."""
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu = rss = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu += (int(fields[11]) + int(fields[12])) / tick
            rss += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page / 2**20
        except (OSError, IndexError, ValueError):
            continue
    return cpu, rss


def pss_mib(pids: Iterable[int]) -> float:
    """Proportional set size in MiB summed over processes (``/proc/PID/smaps_rollup``): each page
    shared by k processes counts 1/k in each, so the sum is what the group holds — unlike a sum of
    resident sets, which counts torch's libraries and Ray's shared-memory object store once per
    process that touched them. nan where there is no smaps_rollup."""
    total, seen = 0.0, False
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
                    seen = True
                    break
        except OSError:
            continue
    return total if seen else float("nan")


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: times are noisy when other jobs share the CPUs."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine() -> str:
    """One line for a table's title: the CPUs and how busy they were."""
    return f"{os.cpu_count()} CPUs, load average {load_average()}"


def _params(args: object | None) -> dict[str, Any]:
    """The flags as MLflow params: lists space-separated, unset and bookkeeping flags left out."""
    pairs = ((k, " ".join(map(str, v)) if isinstance(v, (list, tuple)) else v)
             for k, v in (vars(args) if args is not None else {}).items())
    return {k: v for k, v in pairs if v not in (None, "") and k not in ("no_track", "experiment")}


def track(args: object | None, name: str, rows: Sequence[Mapping] = (), text: str | None = None, *,
          params: Mapping[str, Any] | None = None, metrics: Metrics = (),
          plots: Callable[[Path], Iterable[Path]] | None = None, plot_folder: str | None = None,
          experiment: str | None = None) -> str | None:
    """Log a benchmark's result as one MLflow run ``name`` (tag ``pfl.pipeline``) and print where it
    is; with ``--no-track`` nothing, not even an import of MLflow. Returns the run's id or None.

    Params: the flags (``args``, parsed), ``params``, the machine. ``metrics``: a mapping or (mapping,
    step) pairs. ``rows``/``text`` become ``NAME.csv``/``NAME.md`` (:func:`pfl.runner.write_table`);
    ``plots`` draws into a temporary folder and returns the files (logged under ``plot_folder``), so
    an untracked run never draws. A failure while logging ends the run FAILED and is raised."""
    if args is not None and getattr(args, "no_track", False):
        return None
    from .runner import write_table
    from .tracking import Tracker, run_hint

    exp = experiment or getattr(args, "experiment", None)
    tracker = Tracker.start(exp, name, tags={"pfl.pipeline": name})
    try:
        tracker.log_params({**_params(args), **(params or {}), "cpus": os.cpu_count(), "load_average": load_average()})
        for values, step in ([(metrics, None)] if isinstance(metrics, Mapping) else metrics):
            tracker.log_metrics(values, step=step)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp)
            if rows or text is not None:
                write_table(tracker, [dict(r) for r in rows], name, text, out)
            for path in plots(out) if plots else ():
                tracker.log_artifact(path, plot_folder)
    except BaseException:
        tracker.end("FAILED")
        raise
    tracker.end("FINISHED")
    print(run_hint(tracker.run_id, what="MLflow run"), flush=True)
    return tracker.run_id


def main(run: Callable[[list[str]], int], argv: Sequence[str] | None = None,
         child: Callable[[dict], Any] | None = None) -> int:
    """A script's ``__main__``: ``--child SPEC`` prints ``child(SPEC)`` as JSON (the measuring side
    of :func:`run_child`); otherwise ``run(argv)``, with a config error printed as ``pfl run``
    prints it (one line, ``config error: FIELD: ...``) and exit status 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if child is not None and argv[:1] == [CHILD_FLAG]:
            print(json.dumps(child(json.loads(argv[1]))), flush=True)
            return 0
        return run(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
