"""pfl/bench.py, the benchmark pipelines' shared skeleton: a measurement in a real child process
and back, a config error as one line and exit status 2, the MLflow run every benchmark ends with
(and nothing with --no-track), and the pipelines that use it keeping to it."""

from __future__ import annotations

import ast
import csv
import math
import os
import sys
import textwrap
from pathlib import Path

import pytest

from pfl import bench
from pfl.schema import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SKELETON_USERS = ["bench_cohort", "bench_data", "bench_fedslr", "bench_fpfc", "bench_round", "bench_scale",
                  "bench_threads", "bench_tune", "bench_workers"]


def script(tmp_path: Path, body: str) -> Path:
    """A benchmark-shaped script whose child runs ``body`` (``spec`` in scope) and returns ``out``."""
    path = tmp_path / "tiny_bench.py"
    path.write_text(textwrap.dedent("""\
        import sys

        from pfl import bench


        def child(spec):
            print("a library's chatter before the result")
        {body}
            return out


        if __name__ == "__main__":
            sys.exit(bench.main(lambda argv: 0, child=child))
        """).format(body=textwrap.indent(textwrap.dedent(body), "    ")))
    return path


def test_a_child_measures_a_spec_and_hands_back_its_result(tmp_path):
    path = script(tmp_path, """\
        import os
        out = {"twice": spec["x"] * 2, "rss": bench.rss_mib(), "peak": bench.peak_rss_mib(),
               "env": os.environ.get("BENCH_TEST"), "path": os.environ["PYTHONPATH"].split(os.pathsep)}
        """)
    out = bench.run_child(path, {"x": 21}, "the tiny bench", env={"BENCH_TEST": "seen"})
    assert out["twice"] == 42 and out["env"] == "seen"
    assert out["path"][0] == str(ROOT)                            # the child measures this very pfl
    assert 1 < out["rss"] < 10_000 and 1 < out["peak"] < 10_000   # MiB of a small Python process


def test_a_failing_child_raises_with_its_stderr_tail(tmp_path):
    path = script(tmp_path, """\
        raise ValueError("no such population: " + str(spec["clients"]))
        """)
    with pytest.raises(RuntimeError) as err:
        bench.run_child(path, {"clients": 7}, "fedavg at 7 clients")
    message = str(err.value)
    assert message.startswith("fedavg at 7 clients failed (exit 1)")
    assert "ValueError: no such population: 7" in message             # the traceback's last line


def test_a_config_error_in_a_child_reaches_the_parent_as_one_line(tmp_path):
    path = script(tmp_path, """\
        from pfl.schema import ConfigError
        raise ConfigError("data.num_clients", "must be at least 1, got 0")
        """)
    with pytest.raises(RuntimeError, match=r"\(exit 2\):\nconfig error: data\.num_clients: must be at least 1"):
        bench.run_child(path, {}, "the child")


def test_a_child_without_a_result_line_is_an_error():
    with pytest.raises(RuntimeError, match="printed no JSON result"):
        bench.run_json([sys.executable, "-c", "print('done, no result')"], "a silent child")


def test_a_config_error_is_one_line_and_exit_status_2(capsys):
    def run(argv):
        assert argv == ["--rounds", "0"]
        raise ConfigError("federation.rounds", "must be at least 1, got 0")

    assert bench.main(run, ["--rounds", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "config error: federation.rounds: must be at least 1, got 0\n"


def test_main_runs_the_script_and_lets_other_errors_through(capsys):
    assert bench.main(lambda argv: 3, ["--x"]) == 3
    assert bench.main(lambda argv: 0, ["--child", '{"a": 1}'], child=lambda spec: {"b": spec["a"] + 1}) == 0
    assert capsys.readouterr().out == '{"b": 2}\n'
    with pytest.raises(KeyError):
        bench.main(lambda argv: {}["missing"], [])


def test_the_parser_has_the_common_flags():
    args = bench.parser("the doc", experiment=True).parse_args(["--no-track", "--experiment", "e"])
    assert args.no_track and args.experiment == "e"
    plain = bench.parser("the doc")
    assert plain.description == "the doc" and not plain.parse_args([]).no_track
    with pytest.raises(SystemExit):
        plain.parse_args(["--experiment", "e"])


def test_the_machine_line_names_the_cpus_and_the_load():
    loads = bench.load_average().split()
    assert len(loads) == 3 and all(float(x) >= 0 for x in loads)
    assert bench.machine().startswith(f"{__import__('os').cpu_count()} CPUs, load average ")
    assert math.isnan(bench.rss_mib("NoSuchKey"))


def tracked_args(*flags: str):
    parser = bench.parser(None)
    parser.add_argument("--methods", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--store-dir", default=None)
    return parser.parse_args(list(flags))


def test_the_tracking_tail_writes_one_finished_run(tmp_path, capsys):
    import mlflow

    drawn = []

    def plots(out: Path) -> list[Path]:
        drawn.append(out / "tiny.png")
        drawn[-1].write_bytes(b"png")
        return drawn

    rows = [{"method": "fedavg", "round_s": 0.25}, {"method": "ditto", "round_s": 0.5, "stored": 300}]
    run_id = bench.track(tracked_args(), "bench_tiny", rows, "== bench_tiny ==\n| method |\n|---|\n| fedavg |",
                         params={"params": 34186}, metrics=[({"fedavg/round_s": 0.25}, 300), ({"x": 1.0}, None)],
                         plots=plots, plot_folder="plots")
    assert run_id and run_id in capsys.readouterr().out                # the closing hint names the run
    client = mlflow.tracking.MlflowClient()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "bench_tiny"
    assert run.data.tags["pfl.pipeline"] == "bench_tiny"
    params = run.data.params
    assert params["methods"] == "fedavg ditto" and params["rounds"] == "2" and params["params"] == "34186"
    assert "store_dir" not in params and "no_track" not in params     # unset and bookkeeping flags left out
    assert "cpus" in params and len(params["load_average"].split()) == 3
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "fedavg/round_s")] == [(300, 0.25)]
    names = {a.path for a in client.list_artifacts(run_id)}
    assert {"bench_tiny.csv", "bench_tiny.md", "plots"} <= names
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == ["plots/tiny.png"]
    with open(client.download_artifacts(run_id, "bench_tiny.csv", str(tmp_path / "got"))) as fh:
        table = list(csv.DictReader(fh))
    assert [r["method"] for r in table] == ["fedavg", "ditto"] and table[1]["stored"] == "300"
    md = Path(client.download_artifacts(run_id, "bench_tiny.md", str(tmp_path / "got"))).read_text()
    assert md.startswith("## bench_tiny") and "| fedavg |" in md


def test_a_failure_while_logging_ends_the_run_failed(tmp_path):
    import mlflow

    def plots(out: Path) -> list[Path]:
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        bench.track(tracked_args(), "bench_tiny", [{"a": 1}], plots=plots)
    client = mlflow.tracking.MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.status for r in runs] == ["FAILED"]


def test_no_track_writes_nothing(tmp_path, capsys):
    def plots(out: Path) -> list[Path]:
        raise AssertionError("drawn without tracking")

    assert bench.track(tracked_args("--no-track"), "bench_tiny", [{"a": 1}], "text", plots=plots) is None
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "mlflow.db").exists()                      # not even a store was opened


@pytest.mark.parametrize("name", SKELETON_USERS)
def test_the_pipelines_keep_to_the_skeleton(name):
    """No parser, tracker or sys.path insert of their own (a child's code string may insert), no
    script importing another, and their entry point through bench.main."""
    source = (ROOT / "pipelines" / f"{name}.py").read_text()
    tree = ast.parse(source)
    scripts = {p.stem for p in (ROOT / "pipelines").glob("*.py")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & scripts
        elif isinstance(node, ast.ImportFrom):
            assert node.module and node.module.split(".")[0] not in scripts
            assert node.module != "pfl.tracking"
        elif isinstance(node, ast.Attribute):
            assert node.attr not in ("ArgumentParser", "getrusage")
            assert not (node.attr == "path" and isinstance(node.value, ast.Name) and node.value.id == "sys")
    assert "bench.main(main" in source and "bench.parser(__doc__" in source


def test_proc_cpu_and_rss_reads_this_process_and_skips_a_gone_one():
    """/proc's numbers for this process against getrusage's CPU time and VmRSS, independent reads."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, rss = bench.proc_cpu_and_rss([os.getpid()])
    assert cpu == pytest.approx(usage.ru_utime + usage.ru_stime, abs=0.1)
    assert rss == pytest.approx(bench.rss_mib(), rel=0.05)
    assert bench.proc_cpu_and_rss([2**22 + 7]) == (0.0, 0.0)    # above Linux's pid limit: no such process


def test_bench_workers_refuses_a_flower_python_that_is_not_there(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "pipelines" / "bench_workers.py"), "--flower",
                           str(tmp_path / "nope"), "--no-track"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--flower" in proc.stderr and "not an executable Python" in proc.stderr
