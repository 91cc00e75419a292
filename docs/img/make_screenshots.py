"""The README's MLflow screenshots (docs/img/mlflow_*.png): what a reader sees after tune_fpfc.

    python3 docs/img/make_screenshots.py                  # a smoke tune_fpfc run into a new store, then the pictures
    python3 docs/img/make_screenshots.py --store DIR      # a store that already holds a tune_fpfc run
                                                          # (DIR/mlflow.db, artifacts in DIR/mlartifacts)

Starts `mlflow server` on that store (127.0.0.1, a free port), opens it in headless Chromium and
saves: the sweeps experiment's runs table in the model-training view, through the saved view the
pipeline prints (its key metric columns; every run expanded), the pipeline run's overview, and its
`plots/lambda_selection.png` and `strategies.md` in the artifact browser. Needs Chromium (Debian: `apt-get install
chromium`) and the Python package `playwright` (`pip install playwright`; the system Chromium is
used, so no browser download). The server is stopped at the end, also on an error.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def smoke_run(store: Path) -> None:
    env = dict(os.environ, MLFLOW_TRACKING_URI=f"sqlite:///{store / 'mlflow.db'}", PYTHONPATH=str(ROOT),
               PFL_CACHE_DIR=str(store / "cache"))
    subprocess.run([sys.executable, str(ROOT / "pipelines" / "tune_fpfc.py"), "--smoke", "--storage",
                    str(store / "ray_results")], cwd=store, env=env, check=True)


def pipeline_run(uri: str):
    from mlflow.tracking import MlflowClient

    mc = MlflowClient(tracking_uri=uri)
    runs = [r for e in mc.search_experiments() for r in mc.search_runs(
        [e.experiment_id], filter_string="tags.`pfl.pipeline` = 'tune_fpfc' and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time DESC"])]
    if not runs:
        raise SystemExit(f"no finished tune_fpfc run in {uri}; run without --store to make one")
    return runs[0]


def serve(uri: str, port: int, log: Path) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host",
                               "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"mlflow server exited ({server.returncode}); see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(1)
    server.terminate()
    raise SystemExit(f"mlflow server did not answer within 120 s; see {log}")


def stop(server: subprocess.Popen) -> None:
    """The server and its job workers (one process group): SIGTERM, then SIGKILL after a minute."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


EXPANDER = "button[data-component-id$='runnamecellrenderer.tsx_46']"   # the [+] beside a parent run's name
PLUS = "M7.25 7.25V4.5"                                                   # the plus sign's path (collapsed)


def expand_all(page) -> None:
    """Open every parent row of the runs table (the sweeps under the pipeline, the trials under them)."""
    for _ in range(6):
        closed = [b for b in page.locator(EXPANDER).all() if PLUS in (b.inner_html() or "")]
        if not closed:
            return
        closed[0].click()
        page.wait_for_timeout(2500)


def tidy(page) -> None:
    """Close the assistant panel MLflow opens beside every page (it is not pfl's)."""
    for button in page.get_by_role("button", name="Close").all():
        try:
            if button.is_visible():
                button.click()
                page.wait_for_timeout(500)
        except Exception:  # gone with the panel
            pass


def shoot(base: str, run, out: Path, browser_path: str) -> list[Path]:
    from playwright.sync_api import sync_playwright

    from pfl.tracking_store import MODEL_TRAINING_VIEW, experiment_url, run_url

    exp, run_id = run.info.experiment_id, run.info.run_id
    pages = {  # (address, text that shows the page has loaded)
        "mlflow_experiment.png": (experiment_url(exp, base, "tune_fpfc"), run.info.run_name),
        "mlflow_pipeline_run.png": (run_url(run_id, exp, base), "Description"),
        "mlflow_lambda_selection.png": (f"{base}/#/experiments/{exp}/runs/{run_id}/artifacts/plots/"
                                        f"lambda_selection.png?{MODEL_TRAINING_VIEW}", "lambda_selection.png"),
        "mlflow_strategies.png": (f"{base}/#/experiments/{exp}/runs/{run_id}/artifacts/strategies.md"
                                  f"?{MODEL_TRAINING_VIEW}", "strategies.parquet"),
    }
    written = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=browser_path, args=["--no-sandbox", "--disable-gpu"])
        for name, (url, ready) in pages.items():
            # a new page each time: from one artifact to another only the address's hash changes
            page = browser.new_page(viewport={"width": 1600, "height": 1100}, device_scale_factor=1)
            page.goto(url, wait_until="load")  # never "networkidle": the runs table refreshes itself
            page.get_by_text(ready).first.wait_for(timeout=180_000)
            page.wait_for_timeout(8000)  # the page's own requests after its first paint
            tidy(page)
            if name == "mlflow_experiment.png":
                expand_all(page)
            if name == "mlflow_pipeline_run.png":  # the description's tables, not only its first lines
                more = page.get_by_text("Show more")
                if more.count():
                    more.first.click()
            page.wait_for_timeout(2000)
            page.screenshot(path=str(out / name))
            page.close()
            written.append(out / name)
        browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", help="folder with mlflow.db (and mlartifacts/) holding a tune_fpfc run")
    parser.add_argument("--out", default=str(OUT), help="where the PNG files go (default: docs/img)")
    parser.add_argument("--server", help="an MLflow server already serving the store (e.g. http://127.0.0.1:5000)")
    parser.add_argument("--browser", help="Chromium executable (default: the first of chromium, chromium-browser, "
                                          "google-chrome on PATH)")
    args = parser.parse_args(argv)
    browser = args.browser or next((p for p in map(shutil.which, BROWSERS) if p), None)
    if not browser:
        print("config error: --browser: no Chromium found (apt-get install chromium, or give its path)",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(args.store).resolve() if args.store else Path(tmp)
        if not args.store:
            smoke_run(store)
        uri = f"sqlite:///{store / 'mlflow.db'}"
        run = pipeline_run(uri)
        if args.server:
            files = shoot(args.server.rstrip("/"), run, Path(args.out), browser)
        else:
            port = free_port()
            server = serve(uri, port, store / "mlflow_server.log")
            try:
                files = shoot(f"http://127.0.0.1:{port}", run, Path(args.out), browser)
            finally:
                stop(server)
    for path in files:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
