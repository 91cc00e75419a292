"""What kind of MLflow store pfl writes to, and what follows from the kind.

Three kinds matter (:func:`store_kind`):

- ``server``: an ``http(s)://`` tracking URI, i.e. an ``mlflow server``. Artifacts go through the
  server (``--serve-artifacts``, on by default in MLflow 3): pfl creates its experiments without an
  artifact location, so the server gives them ``mlflow-artifacts:/...`` and every node uploads
  to it. Nothing is written to the client machine's disk.
- ``sqlite``: a local database file; artifacts in a folder beside it (``file://``).
- ``database``: ``postgresql[+driver]://``, ``mysql...://``, ``mssql...://``, written to directly
  by every process; artifacts where ``artifact_root`` says.

:func:`preflight` is the check a driver runs before it starts anything: one request without
retries, so an unreachable server, a server whose database is down, or a refused login fails in
seconds with one line naming ``MLFLOW_TRACKING_URI`` (MLflow's own client retries a refused
connection for about a minute). :class:`GuardedClient` turns a store that stops answering in the
middle of a run into :class:`TrackingStoreError`; once that happened in a process, every later call
is preceded by such a quick check, so a driver closing its runs does not wait a minute per call.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .schema import ConfigError

KEY = "MLFLOW_TRACKING_URI"
DATABASES = ("postgresql", "mysql", "mssql")
# MLflow's client reads these for a server's credentials (and ~/.mlflow/credentials for the first two)
AUTH_VARIABLES = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
UI_PORT = 5000  # `mlflow ui`'s default
MODEL_TRAINING_VIEW = "workflowType=machine_learning"  # MLflow 3's UI opens on its GenAI view otherwise


class TrackingStoreError(ConfigError):
    """The tracking store cannot be reached or refuses pfl (named by ``MLFLOW_TRACKING_URI``)."""

    def __init__(self, uri: str, problem: str):
        self.uri, self.problem = uri, problem
        super().__init__(KEY, f"{redact(uri)}: {problem}")

    def __reduce__(self):  # Ray sends a trial's exception to the driver pickled
        return type(self), (self.uri, self.problem)


def store_kind(uri: str) -> str:
    """``server``, ``sqlite``, ``database`` or ``other`` (e.g. ``databricks``, ``file:``)."""
    scheme = urlsplit(uri).scheme.lower()
    if scheme in ("http", "https"):
        return "server"
    if scheme == "sqlite":
        return "sqlite"
    if scheme.split("+")[0] in DATABASES:
        return "database"
    return "other"


def redact(uri: str) -> str:
    """The URI without a password (``postgresql://user:secret@host`` -> ``user:***@host``)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


# ---- URLs and hints ---------------------------------------------------------------------------

def run_url(run_id: str, experiment_id: str | None, uri: str) -> str:
    """The web page of a run in the model-training view: the server's own page, or the page a local
    ``mlflow ui`` serves for a database store. Without the experiment id: MLflow's direct run
    route, which finds the experiment itself."""
    base = uri.rstrip("/") if store_kind(uri) == "server" else f"http://127.0.0.1:{UI_PORT}"
    path = f"experiments/{experiment_id}/runs/{run_id}" if experiment_id else f"runs/{run_id}"
    return f"{base}/#/{path}?{MODEL_TRAINING_VIEW}"


def experiment_url(experiment_id: str, uri: str, view: str | None = None) -> str:
    """An experiment's runs table in the model-training view, opened on a saved view (its columns
    and order, :data:`SAVED_VIEW_TAG`) when ``view`` names one."""
    base = uri.rstrip("/") if store_kind(uri) == "server" else f"http://127.0.0.1:{UI_PORT}"
    # the runs tab itself: the experiment's bare address redirects there and drops the view key
    return f"{base}/#/experiments/{experiment_id}/runs?{MODEL_TRAINING_VIEW}" + (
        f"&viewStateShareKey={view}" if view else "")


# MLflow's UI keeps a runs table's chosen columns in the browser; a view saved as this experiment
# tag (+ a key) is one every browser opens with ?viewStateShareKey=<key> (MLflow 3's "share" link)
SAVED_VIEW_TAG = "mlflow.sharedViewState."


def saved_view(name: str, columns: list[tuple[str, str]], order_by: tuple[str, str] | None = None,
               ascending: bool = False) -> str:
    """The tag value of a saved runs-table view named ``name`` (listed under the runs table's
    *Views*): ``columns`` as (kind, key) with kind ``metrics``, ``params``, ``tags`` or
    ``attributes``, sorted by ``order_by`` (same form). The envelope is the one MLflow's UI writes."""
    import json
    import time

    def column(kind: str, key: str) -> str:
        return f"{kind}.`{key}`"

    chosen = [column(k, v) for k, v in columns]
    state: dict[str, Any] = {"selectedColumns": chosen, "columnOrder": chosen, "runsHiddenMode": "SHOW_ALL",
                             "columnWidths": {c: 130 for c in chosen}}  # room for a value's digits
    if order_by:
        state.update(orderByKey=column(*order_by), orderByAsc=ascending)
    now = int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": now, "updatedAt": now, "state": json.dumps(state)})


def view_hint(run_id: str, experiment_id: str | None, uri: str, what: str = "MLflow run") -> str:
    """One line: where a run is and how a person looks at it, right for the kind of store."""
    url = run_url(run_id, experiment_id, uri)
    if store_kind(uri) == "server":
        return f"{what} {run_id}: {url}"
    return f"{what} {run_id}; view: mlflow ui --backend-store-uri {redact(uri)}  (then open {url})"


# ---- artifacts --------------------------------------------------------------------------------

def local_location(location: str | None) -> bool:
    """True for an artifact location on some machine's own disk (``file:`` or a bare path)."""
    return bool(location) and (location.startswith("file:") or "://" not in location
                               and not location.startswith("mlflow-artifacts:"))


def location_warning(name: str, experiment_id: str, location: str | None, uri: str) -> str | None:
    """The warning for an experiment that a server holds but whose artifacts live on one client's
    disk (made by an older pfl, or by a client with a local artifact root)."""
    if store_kind(uri) != "server" or not local_location(location):
        return None
    return (f"MLflow experiment '{name}' (id {experiment_id}) on {redact(uri)} keeps its artifacts at {location}, "
            "on the disk of the machine that writes them, not on the server; give pfl a new experiment (mlflow.yaml "
            f"'experiment' / 'sweep_experiment', or rename this one: mlflow experiments rename --experiment-id "
            f"{experiment_id} --new-name '{name}-local') so the server stores the artifacts")


# ---- reachability -----------------------------------------------------------------------------

def _cause(text: str) -> str:
    """A short reason from an MLflow/requests/SQLAlchemy error message."""
    low = text.lower()
    code = re.search(r"too many (\d{3}) error responses|error code (\d{3})|\bHTTP (\d{3})", text)
    status = next((g for g in code.groups() if g), None) if code else None
    if status:
        return f"HTTP {status}"
    if "connection refused" in low:
        return "connection refused"
    if any(w in low for w in ("connection reset", "connection aborted", "remote end closed", "broken pipe")):
        return "connection lost"  # the server went away while it handled the request
    if "timed out" in low or "timeout" in low:
        return "no answer (timed out)"
    if "name or service not known" in low or "nodename nor servname" in low or "failed to resolve" in low:
        return "unknown host"
    if "max retries exceeded" in low:
        return "no answer"
    return text.strip().splitlines()[0][:200] if text.strip() else "unknown error"


def _auth_problem(status: int) -> str:
    given = [v for v in AUTH_VARIABLES if os.environ.get(v)]
    said = "refused the credentials from " + ", ".join(given) if given else "requires a login"
    return (f"the MLflow server {said} (HTTP {status}); MLflow's client reads MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (basic auth; or ~/.mlflow/credentials) or MLFLOW_TRACKING_TOKEN (a bearer "
            "token): set them where the pipeline starts (they are passed on to the Ray trials)")


def _server_message(response) -> str:
    try:
        body = response.json()
        text = str(body.get("message") or body.get("error_code") or "")
    except ValueError:
        text = response.text
    text = re.sub(r"\(Background on this error at: [^)]*\)", "", text)  # SQLAlchemy's link
    return " ".join(text.split())[:240]


def check_server(uri: str, timeout: float = 5.0) -> None:
    """One request that needs the server's database, no retries (see the module docstring)."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(get_default_host_creds(uri), "/api/2.0/mlflow/experiments/search", "GET",
                                max_retries=0, backoff_factor=0, timeout=timeout, raise_on_status=False,
                                params={"max_results": 1})
    except (requests.exceptions.RequestException, MlflowException) as err:  # MLflow wraps most of them
        if "read timed out" in str(err).lower():  # connected, but the server did not answer
            raise TrackingStoreError(uri, f"the MLflow server took the connection but sent no answer within "
                                          f"{timeout:g} s (is its database up?)") from None
        raise TrackingStoreError(uri, f"no MLflow server answers ({_cause(str(err))})") from None
    if response.status_code in (401, 403):
        raise TrackingStoreError(uri, _auth_problem(response.status_code))
    if response.status_code == 404:
        raise TrackingStoreError(uri, "HTTP 404: this is not the address of an MLflow tracking server "
                                      "(the URL the UI opens at, e.g. http://HOST:5000)")
    if response.status_code >= 500:
        raise TrackingStoreError(uri, f"the MLflow server answers but cannot use its database (HTTP "
                                      f"{response.status_code}: {_server_message(response)})")
    if response.status_code != 200:
        raise TrackingStoreError(uri, f"the MLflow server answered HTTP {response.status_code}: "
                                      f"{_server_message(response)}")


def check_database(uri: str, timeout: float = 5.0) -> None:
    """Connect once with a short timeout (MLflow's own engine set-up retries for about 100 s)."""
    import sqlalchemy

    dialect = urlsplit(uri).scheme.split("+")[0]
    connect_args = {"connect_timeout": int(timeout)} if dialect in ("postgresql", "mysql") else {}
    try:
        engine = sqlalchemy.create_engine(uri, connect_args=connect_args)
    except ModuleNotFoundError as err:
        hint = (" (pip install -e '.[postgres]' installs psycopg 3: write the URI as postgresql+psycopg://...)"
                if dialect == "postgresql" else "")
        raise TrackingStoreError(uri, f"the database driver is not installed: {err}{hint}") from None
    try:
        with engine.connect():
            pass
    except Exception as err:
        first = " ".join(str(getattr(err, "orig", None) or err).split())[:240]
        raise TrackingStoreError(uri, f"the database does not answer ({first})") from None
    finally:
        engine.dispose()


def preflight(uri: str, timeout: float = 5.0) -> None:
    kind = store_kind(uri)
    if kind == "server":
        check_server(uri, timeout)
    elif kind == "database":
        check_database(uri, timeout)


# ---- a client that fails fast once the store is gone ----------------------------------------

_LOST: set[str] = set()   # stores that stopped answering in this process


def store_error(uri: str, err: BaseException) -> TrackingStoreError | None:
    """``err`` as a TrackingStoreError when it says the store is unreachable or refuses pfl."""
    if isinstance(err, TrackingStoreError):
        return err
    text = str(err)
    if store_kind(uri) == "server" and "API request to" in text:
        cause = _cause(text)
        if cause in ("HTTP 401", "HTTP 403"):
            return TrackingStoreError(uri, _auth_problem(int(cause[-3:])))
        if cause.startswith("HTTP 5"):
            return TrackingStoreError(uri, f"the MLflow server failed ({cause}; its database may be down)")
        return TrackingStoreError(uri, f"the MLflow server stopped answering ({cause})")
    name = type(err).__name__
    if store_kind(uri) == "database" and name in ("OperationalError", "InterfaceError"):
        return TrackingStoreError(uri, f"the database stopped answering ({_cause(text)})")
    return None


class GuardedClient:
    """An MlflowClient whose calls raise :class:`TrackingStoreError` when the store is gone."""

    def __init__(self, client, uri: str):
        self._client = client
        self._uri = uri

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if self._uri in _LOST:
                preflight(self._uri, timeout=3.0)  # raises at once while it is still gone
                _LOST.discard(self._uri)
            try:
                return attr(*args, **kwargs)
            except Exception as err:
                failure = store_error(self._uri, err)
                if failure is None:
                    raise
                _LOST.add(self._uri)
                raise failure from None

        return call


def store_lost(uri: str) -> bool:
    """Whether the store stopped answering in this process (and still does not answer)."""
    if uri not in _LOST:
        return False
    try:
        preflight(uri, timeout=3.0)
    except TrackingStoreError:
        return True
    _LOST.discard(uri)
    return False


# ---- what trials need -------------------------------------------------------------------------

def worker_environment(base: dict[str, str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` plus every ``MLFLOW_*`` variable of this process (credentials, HTTP retries and
    timeouts): trials on other nodes inherit the environment of `ray start`, not the driver's."""
    environ = os.environ if environ is None else environ
    extra = {k: v for k, v in environ.items() if k.startswith("MLFLOW_") and k not in base}
    return {**extra, **base}
