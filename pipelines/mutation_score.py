"""The truth tests' mutation score over the whole scope of ``[tool.mutmut]`` (docs/verification.md,
"Mutation score"; issue 42): run every mutant, or time a sample to say how long that takes, and score.

mutmut 3 selects the tests per mutant itself: its stats run records which selected tests call each
mutated function (``mutants/mutmut-stats.json``), and a mutant runs only those, stopping at the first
failure (``pytest -x``), in a grandchild of a fork server that has only collected the tests
(``process_isolation = "forkserver"``). This script drives it in resumable batches and reads the
results (``mutants/**/*.meta``):

    python3 pipelines/mutation_score.py generate                 # mutants + stats (~2 min)
    python3 pipelines/mutation_score.py estimate --n 40 --seed 1 # time 40 random mutants, extrapolate
    python3 pipelines/mutation_score.py run --children 1         # every mutant not run yet (resumable)
    python3 pipelines/mutation_score.py score                    # killed / (all − equivalent), survivors

``run --names FILE`` runs the mutants named in FILE (one a line), ``run --rerun`` those with a result
too; ``score --sample N --seed S`` scores a seeded sample of N (``estimate``'s or ``sample``'s names).

The equivalent mutants — those no test can kill because they compute the same thing — are listed in
``pipelines/mutation_equivalents.txt`` (``NAME  # reason``), each argued in a row of
docs/verification.md; ``score`` leaves them out of the denominator and names any that no longer exist.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENTS = ROOT / "pipelines" / "mutation_equivalents.txt"
DIRECT = "direct-results.jsonl"  # the direct runner's results (direct_run)
# pytest's unraisable/thread-exception plugins collect garbage 5 times at exit: 0.5 s of the 0.6 s a
# mutant's run costs beyond its tests, in a child that exits anyway (the math reports no such errors)
QUIET_PLUGINS = ("-p", "no:cacheprovider", "-p", "no:unraisableexception", "-p", "no:threadexception",
                 "--rootdir", ".")  # test ids relative to mutants/, as mutmut's stats name them, on any machine
BATCH = 150  # mutants per `mutmut run` call: results are saved per mutant, a stopped run loses little

# mutmut 3's exit codes (mutmut/stats.py); a timeout counts as not killed here (conservative)
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped",
          35: "suspicious", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout",
          37: "caught by type check", -11: "segfault", -9: "segfault", None: "not run"}
DETECTED = ("killed", "caught by type check")


def results(root: Path = ROOT) -> dict[str, int | None]:
    """Every mutant name → its exit code (None: not run yet): mutmut's, overridden by the direct
    runner's where that still holds (:func:`_valid_rows`). A survivor needs the direct runner's word:
    mutmut keeps a verdict while its function is unchanged, though its file or tests changed since."""
    out: dict[str, int | None] = {}
    for meta in sorted((root / "mutants").rglob("*.meta")):
        out.update({k: None if c == 0 else c for k, c in json.loads(meta.read_text())["exit_code_by_key"].items()})
    out.update({row["name"]: row["code"] for row in _valid_rows(root) if row["name"] in out})
    return out


def _file_hash(root: Path, module: str) -> str:
    path = root / "mutants" / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = path.with_suffix("") / "__init__.py"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path.exists() else ""


def _tests_digest(tests) -> str:
    return hashlib.sha256("\n".join(sorted(tests)).encode()).hexdigest()[:16]


def _valid_rows(root: Path = ROOT) -> list[dict]:
    """The direct runner's results that still hold: run on the mutated file as it is now, and either
    killed or run with the covering tests mutmut's stats name now and the tests sharing their
    module-scoped fixtures (a test added since may kill a survivor, or cover a mutant that had none)."""
    path = root / "mutants" / DIRECT
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    tests_by_fn, _ = covering_tests(root)
    hashes = {f: _file_hash(root, f) for f in {r["file"] for r in rows}}
    return [r for r in rows if r["hash"] == hashes[r["file"]]
            and (STATUS.get(r["code"]) in DETECTED
                 or r.get("scope") in ("fixtures", "files")  # a survivor of the tests sharing fixtures too
                 and r.get("tests") == _tests_digest(tests_by_fn.get(function_of(r["name"]), ())))]


def _direct_results(root: Path = ROOT) -> set[str]:
    """The mutants with a direct result that still holds."""
    return {r["name"] for r in _valid_rows(root)}


def _cpu_seconds(pid: int, wall: float) -> float:
    """A child's CPU time (a paused run, ``kill -STOP``, times nothing out); else its wall time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return wall


def _clean_failures(tests: list[str], jobs: int, pytest) -> set[str]:
    """The tests that fail with no mutant active, run in ``jobs`` forked children."""
    folder = Path(tempfile.mkdtemp())
    pids = []
    for j in range(jobs):
        chunk = tests[j::jobs]
        if not chunk:
            continue
        pid = os.fork()
        if pid == 0:
            class Failed:
                def pytest_runtest_logreport(self, report):
                    if report.failed:
                        with open(folder / f"{j}.txt", "a") as f:
                            f.write(report.nodeid + "\n")
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, 1), os.dup2(fd, 2)
            os.environ["MUTANT_UNDER_TEST"] = ""
            try:
                pytest.main(["-q", *QUIET_PLUGINS, *chunk], plugins=[Failed()])
            finally:
                os._exit(0)
        pids.append(pid)
    for pid in pids:
        os.waitpid(pid, 0)
    return {line for f in folder.glob("*.txt") for line in f.read_text().split()}


def direct_run(names: list[str], jobs: int, deadline_s: float, root: Path = ROOT, log=sys.stdout) -> int:
    """Run mutants without mutmut's driver, which needs only pytest and mutmut's trampoline module
    (so it runs where mutmut's command line does not, e.g. a many-core machine without libcst: a copy
    of mutmut's package and its dist-info on ``PYTHONPATH`` is enough, the trampoline imports only the
    standard library; run it with ``--names`` on the names another machine is not running): the
    tests are collected once, then each mutant runs in a child forked from that process (nothing a
    test caches reaches a mutant), its covering tests fastest first with ``-x``, killed past
    5 × their recorded time + 20 s of CPU (a timeout, not killed). Results are appended to
    ``mutants/direct-results.jsonl`` with the hash of the mutated file, so a changed file's results
    are ignored; stops submitting at ``deadline_s``. Returns how many mutants it ran."""
    tests_by_fn, duration = covering_tests(root)
    covered = dict(tests_by_fn)
    selection = sorted({t.partition("::")[0] for ts in tests_by_fn.values() for t in ts})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.chdir(root / "mutants")
    sys.path.insert(0, str(root / "mutants"))
    import pytest

    class Collected:
        ids: set[str] = set()
        shared: dict[str, set[tuple]] = {}  # test → (its file, fixture) of each module-scoped fixture it uses

        def pytest_collection_finish(self, session):
            Collected.ids = {item.nodeid for item in session.items}
            for item in session.items:
                defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
                Collected.shared[item.nodeid] = {(item.path, n) for n, d in defs.items() if d and d[-1].scope == "module"}

    with open(os.devnull, "w") as quiet:  # warm up: import torch, pfl and the test modules once
        saved = os.dup(1), os.dup(2)
        os.dup2(quiet.fileno(), 1), os.dup2(quiet.fileno(), 2)
        try:
            pytest.main(["--collect-only", "-q", *QUIET_PLUGINS, "--continue-on-collection-errors",
                         *selection], plugins=[Collected()])
        finally:
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
    # a test this machine cannot collect (a module that does not import, an id made from what is
    # installed) would end a mutant's run as a usage error, not a verdict
    missing = {t for ts in tests_by_fn.values() for t in ts} - Collected.ids
    if missing:
        print(f"left out, not collected on this machine: {len(missing)} tests, e.g. {sorted(missing)[:5]}",
              file=log, flush=True)
        tests_by_fn = {f: ts - missing for f, ts in tests_by_fn.items()}
    import gc

    gc.freeze()  # the warm-up's objects: a child neither scans them nor copies their pages
    broken = _clean_failures(sorted({t for ts in tests_by_fn.values() for t in ts}), jobs, pytest)
    if broken:  # a test that fails without a mutant here would "kill" every mutant it covers
        print(f"left out, failing without a mutant on this machine: {sorted(broken)}", file=log, flush=True)
        tests_by_fn = {f: ts - broken for f, ts in tests_by_fn.items()}
    universe = {t for ts in tests_by_fn.values() for t in ts}
    start, done, running = time.perf_counter(), 0, {}
    queue = [m for m in names if tests_by_fn.get(function_of(m))]
    skipped = [m for m in names if not covered.get(function_of(m))]  # no test calls it anywhere
    out = open(root / "mutants" / DIRECT, "a")
    hashes: dict[str, str] = {}

    def record(name: str, code: int, seconds: float) -> None:
        f = file_of(name)
        out.write(json.dumps({"name": name, "code": code, "seconds": round(seconds, 2), "file": f,
                              "hash": hashes.setdefault(f, _file_hash(root, f)),
                              "tests": _tests_digest(tests_by_fn.get(function_of(name), ())), "scope": "fixtures"}) + "\n")
        out.flush()

    for name in skipped:
        record(name, 33, 0.0)
    while queue or running:
        while queue and len(running) < jobs and time.perf_counter() - start < deadline_s:
            name = queue.pop(0)
            tests = sorted(tests_by_fn[function_of(name)], key=lambda t: (duration.get(t, 0.0), t))
            # then the tests sharing their module-scoped fixtures: mutmut's stats credit a fixture's calls
            # to the first test that used it, so a later test reading the fixture's result is not "covering"
            fixtures = set().union(*(Collected.shared.get(t, set()) for t in tests))
            rest = sorted((t for t in universe - set(tests) if Collected.shared.get(t, set()) & fixtures),
                          key=lambda t: (duration.get(t, 0.0), t))
            limit = 5 * sum(duration.get(t, 0.0) for t in tests + rest) + 20
            pid = os.fork()
            if pid == 0:  # the child: this mutant only, its output discarded
                code = 3
                try:
                    fd = os.open(os.devnull, os.O_WRONLY)
                    os.dup2(fd, 1), os.dup2(fd, 2)
                    os.environ["MUTANT_UNDER_TEST"] = name
                    code = int(pytest.main(["-x", "-q", *QUIET_PLUGINS, *tests]))
                    if code == 0 and rest:
                        code = int(pytest.main(["-x", "-q", *QUIET_PLUGINS, *rest]))
                finally:
                    os._exit(code)
            running[pid] = (name, time.perf_counter(), limit)
        if queue and time.perf_counter() - start >= deadline_s:
            queue.clear()
        if not running:
            break
        if time.perf_counter() - start >= deadline_s + 30:  # cut, not recorded: a later run does them
            for p in running:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
            break
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            now = time.perf_counter()
            for p, (name, began, limit) in list(running.items()):
                if _cpu_seconds(p, now - began) > limit or now - began > 20 * limit:
                    os.kill(p, signal.SIGKILL)
                    os.waitpid(p, 0)
                    del running[p]
                    record(name, 36, now - began)
                    done += 1
            time.sleep(0.02)
            continue
        name, began, _ = running.pop(pid)
        code = os.waitstatus_to_exitcode(status)
        if code in (2, 4):  # pytest itself was interrupted or misused: no verdict, a later run retries
            print(f"  no verdict for {name}: pytest exit code {code}", file=log, flush=True)
            continue
        record(name, code, time.perf_counter() - began)
        done += 1
        if done % 100 == 0:
            print(f"  {done} of {len(names) - len(skipped)} run, {time.perf_counter() - start:.0f} s",
                  file=log, flush=True)
    out.close()
    return done


def covering_tests(root: Path = ROOT) -> tuple[dict[str, set[str]], dict[str, float]]:
    """mutmut's stats: the tests that call each mutated function, and each test's duration (s)."""
    path = root / "mutants" / "mutmut-stats.json"
    if not path.exists():
        return {}, {}
    stats = json.loads(path.read_text())
    return ({k: set(v) for k, v in stats["tests_by_mangled_function_name"].items()},
            {k: float(v) for k, v in stats["duration_by_test"].items()})


def function_of(name: str) -> str:
    """The mangled function a mutant belongs to (the key of mutmut's stats)."""
    return re.sub(r"__mutmut_\d+$", "", name)


def file_of(name: str) -> str:
    return re.split(r"\.x(?:ǁ|_)", name, maxsplit=1)[0]


def read_equivalents(path: Path = EQUIVALENTS) -> dict[str, str]:
    """NAME → reason from the equivalents file (``NAME  # reason``; blank and ``#`` lines skipped)."""
    out: dict[str, str] = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition("#")
        out[name.strip()] = reason.strip()
    return out


def sample(names, n: int, seed: int) -> list[str]:
    names = sorted(names)
    return sorted(random.Random(seed).sample(names, min(n, len(names))))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return float("nan"), float("nan")
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return centre - half, centre + half


def score(codes: dict[str, int | None], chosen: list[str], equivalents: dict[str, str]) -> str:
    """The report: counts, killed / (all − equivalent), per file, every survivor and stale equivalent."""
    status = {m: STATUS.get(codes[m], "other") for m in chosen}
    equivalent = [m for m in chosen if m in equivalents]
    judged = [m for m in chosen if m not in equivalents and status[m] != "not run"]
    killed = sum(status[m] in DETECTED for m in judged)
    count = Counter(status.values())
    whole = len(chosen) == len(codes)
    lines = [("full set" if whole else "sample") + f": {len(chosen)} of {len(codes)} mutants; "
             + ", ".join(f"{k} {v}" for k, v in sorted(count.items())),
             f"equivalent (pipelines/mutation_equivalents.txt): {len(equivalent)}"]
    if judged:
        lo, hi = wilson(killed, len(judged))
        interval = "" if whole and not count["not run"] else f" (95 % Wilson interval {100 * lo:.1f}–{100 * hi:.1f} %)"
        lines.append(f"score: killed / (run − equivalent) = {killed} / {len(judged)} = "
                     f"{100 * killed / len(judged):.1f} %{interval}")
    else:
        lines.append("score: – (nothing run yet)")
    if count["not run"]:
        lines.append(f"not run yet: {count['not run']} (`run` continues)")
    lines += ["", "per file (killed / judged):"]
    for f in sorted({file_of(m) for m in judged}):
        mine = [m for m in judged if file_of(m) == f]
        lines.append(f"  {f:<40} {sum(status[m] in DETECTED for m in mine):>5} / {len(mine)}")
    rest = sorted(m for m in judged if status[m] not in DETECTED)
    if rest:
        lines += ["", "not killed (mutmut show NAME):"] + [f"  {status[m]:<9} {m}" for m in rest]
        doc = (ROOT / "docs" / "verification.md").read_text()  # every survivor has a row there, by full name
        rowless = [m for m in rest if f"`{m}`" not in doc]
        lines += ["", f"survivors without a row in docs/verification.md: {len(rowless)}"] + [f"  {m}" for m in rowless]
    wrong = sorted(m for m in equivalent if status[m] in DETECTED)
    if wrong:
        lines += ["", "listed as equivalent but a test kills them (take them off the list):"] + [f"  {m}" for m in wrong]
    stale = sorted(set(equivalents) - set(codes))
    if stale:
        lines += ["", "equivalents that are no mutant now (renumbered? re-check them):"] + [f"  {m}" for m in stale]
    return "\n".join(lines)


def mutmut_run(names: list[str], children: int, log=sys.stdout) -> float:
    """``mutmut run`` over ``names`` in batches; returns the wall time in seconds."""
    start = time.perf_counter()
    for i in range(0, len(names), BATCH):
        batch = names[i:i + BATCH]
        proc = subprocess.run(["mutmut", "run", "--max-children", str(children), *batch], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        tail = [ln for ln in proc.stdout.replace("\r", "\n").splitlines() if "mutations/second" in ln]
        print(f"  batch {i // BATCH + 1}: {len(batch)} mutants, exit {proc.returncode}, "
              f"{tail[-1].strip() if tail else ''} ({time.perf_counter() - start:.0f} s so far)", file=log, flush=True)
        if proc.returncode != 0:
            raise SystemExit(f"{proc.stdout[-3000:]}\nmutmut run failed (exit {proc.returncode})")
    return time.perf_counter() - start


def estimate(codes: dict[str, int | None], names: list[str], seconds: float, children: int) -> str:
    """Extrapolate a timed sample to the whole set, two ways: the mean time per mutant × all, and
    scaled by the covering tests' recorded durations (a mutant costs about the tests it runs)."""
    tests, duration = covering_tests()
    cost = {m: sum(duration.get(t, 0.0) for t in tests.get(function_of(m), ())) for m in codes}
    n_all, per = len(codes), seconds / len(names)
    lines = [f"timed: {len(names)} mutants in {seconds:.0f} s with --max-children {children} "
             f"({per:.2f} s per mutant, including mutmut's start-up per batch)",
             f"estimate (mean × all): {n_all} × {per:.2f} s = {n_all * per / 3600:.1f} h"]
    sampled = sum(cost[m] for m in names)
    if sampled > 0:
        ratio = seconds / sampled
        lines.append(f"estimate (covering-test seconds × {ratio:.2f}, the sample's measured/recorded ratio): "
                     f"{ratio * sum(cost.values()) / 3600:.1f} h (recorded covering-test time of all "
                     f"mutants {sum(cost.values()) / 3600:.1f} h if every one survived)")
    lines.append(f"mutants without a covering test (no run needed): {sum(not tests.get(function_of(m)) for m in codes)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("generate", "run", "direct", "estimate", "sample", "score"))
    parser.add_argument("--children", type=int, default=1, help="mutmut's --max-children (default 1)")
    parser.add_argument("--n", type=int, default=40, help="estimate/sample: mutants drawn (default 40)")
    parser.add_argument("--seed", type=int, default=1, help="estimate/sample/score --sample: seed (default 1)")
    parser.add_argument("--sample", type=int, default=0, help="score: a seeded sample of this size (0: all)")
    parser.add_argument("--names", type=Path, help="run: the mutants named in this file only")
    parser.add_argument("--rerun", action="store_true", help="run: also mutants that have a result")
    parser.add_argument("--jobs", type=int, default=1, help="direct: mutants run at once (default 1)")
    parser.add_argument("--deadline", type=float, default=float("inf"),
                        help="direct: seconds after which no mutant is started (default: none)")
    parser.add_argument("--reverse", action="store_true",
                        help="direct: take the mutants from the end (a second machine on the same set)")
    args = parser.parse_args(argv)

    if args.action == "generate":
        # one named mutant: mutmut (re)generates every mutant and collects the stats, then runs that one
        first = "pfl.aggregation.x_weighted_average__mutmut_1"
        return subprocess.run(["mutmut", "run", "--max-children", str(args.children), first], cwd=ROOT).returncode
    codes = results()
    if not codes:
        print("no mutants: run `python3 pipelines/mutation_score.py generate` first", file=sys.stderr)
        return 2
    if min(args.n, args.children) < 1 or args.sample < 0:
        print("--n and --children must be at least 1, --sample at least 0", file=sys.stderr)
        return 2
    equivalents = read_equivalents()
    if args.action == "sample":
        print("\n".join(sample(codes, args.n, args.seed)))
        return 0
    if args.action == "score":
        chosen = sample(codes, args.sample, args.seed) if args.sample else sorted(codes)
        print(score(codes, chosen, equivalents))
        return 0
    if args.action == "estimate":
        names = sample(codes, args.n, args.seed)
        seconds = mutmut_run(names, args.children)
        print(estimate(codes, names, seconds, args.children))
        print()
        print(score(results(), names, equivalents))
        return 0
    if args.action == "direct":
        ran = _direct_results()
        names = sorted(m for m in codes if m not in equivalents and (args.rerun or m not in ran))
        if args.names:
            names = [n for n in args.names.read_text().split() if n in codes]
        names = names[::-1] if args.reverse else names
        print(f"running {len(names)} mutants directly with {args.jobs} jobs", flush=True)
        start = time.perf_counter()
        done = direct_run(names, max(1, args.jobs), args.deadline)
        print(f"ran {done} in {(time.perf_counter() - start) / 60:.1f} min")
        print(score(results(), sorted(results()), equivalents))
        return 0
    # run
    if args.names:
        names = [n for n in args.names.read_text().split() if n in codes]
    else:
        names = sorted(m for m, c in codes.items() if args.rerun or c is None)
    names = [m for m in names if m not in equivalents]
    print(f"running {len(names)} mutants with --max-children {args.children} in batches of {BATCH}", flush=True)
    seconds = mutmut_run(names, args.children)
    print(f"done in {seconds / 60:.1f} min")
    print(score(results(), sorted(results()), equivalents))
    return 0


if __name__ == "__main__":
    sys.exit(main())
