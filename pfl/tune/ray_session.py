"""The Ray session of a sweep: connect to a cluster (or start a local instance on the loopback
interface), with the token authentication Ray 2.60 clusters may require, failing fast and clearly
when nothing answers or a Ray Client address (``ray://``) is given."""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from typing import Any

from ..schema import ConfigError
from ..tracking import worker_environment

log = logging.getLogger(__name__)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _messages(err: BaseException) -> str:
    """The messages of an exception and of everything it was raised from."""
    parts, seen = [], set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        parts.append(str(err))
        err = err.__cause__ or err.__context__
    return " | ".join(parts)


def check_address(address: str, timeout: float = 5.0) -> None:
    """Refuse ``ray://`` and fail fast when nothing listens at HOST:PORT."""
    if address.startswith("ray://"):
        raise ConfigError("--address", f"{address}: Ray Client (ray://) addresses are not supported: a sweep's "
                                       "Tune driver must run on the cluster (its trials report to it for hours "
                                       "and checkpoints live in its storage). Run the pipeline on the head node "
                                       "with RAY_ADDRESS=HOST:6379 (or --address HOST:6379), or submit it with "
                                       "`ray job submit -- python pipelines/...`.")
    if address in ("auto", "local"):
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("--address", f"{address!r} is not HOST:PORT (e.g. 127.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConfigError("--address", f"no Ray cluster answers at {address} ({err}); start one with "
                                       "`ray start --head --port=PORT` or fix --address / RAY_ADDRESS") from None


def _stay_on_loopback() -> None:
    """Keep this process's Ray node address at 127.0.0.1 (what RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
    does for `ray start`): Ray otherwise advertises the machine's network address."""
    try:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False
    except (ImportError, AttributeError) as err:  # another Ray version: it binds as it likes
        log.debug("could not keep Ray on the loopback interface: %s", err)


def _reload_auth_settings() -> None:
    """Make this process see a changed RAY_AUTH_MODE: Ray caches its config and token at first use."""
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as err:  # another Ray version: the environment may suffice
        log.debug("could not reload Ray's auth settings: %s", err)


def init_ray(address: str | None = None, num_cpus: int | None = None,
             runtime_env: dict[str, Any] | None = None) -> str:
    """Connect to ``address``/``$RAY_ADDRESS``, else start a local instance on 127.0.0.1.
    ``runtime_env`` (pfl.tune.runtime_env) adds what the workers need. Returns a description."""
    import ray

    if ray.is_initialized():
        return "already initialised"
    env = worker_environment()  # the store, and the driver's MLflow login and retry settings
    address = address or os.environ.get("RAY_ADDRESS")
    job_env = dict(runtime_env or {})
    job_env["env_vars"] = {**env, **job_env.get("env_vars", {})}
    kwargs: dict[str, Any] = dict(runtime_env=job_env, log_to_driver=False, configure_logging=False)
    if address:
        check_address(address)
        if address.rpartition(":")[0] in ("127.0.0.1", "localhost", "::1"):
            _stay_on_loopback()  # else Ray swaps 127.0.0.1 for the machine's address and misses the head
        token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
        if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file()):
            # a token is at hand: present it (a cluster without authentication ignores it), rather
            # than wait ~20 s for a token-protected head to refuse the connection
            os.environ["RAY_AUTH_MODE"] = "token"
            _reload_auth_settings()
        try:
            ray.init(address=address, **kwargs)
        except Exception as err:
            # a cluster started with token authentication refuses a driver without the token; on the
            # head machine the token is in ~/.ray/auth_token (or $RAY_AUTH_TOKEN[_PATH])
            text = _messages(err)
            has_token = bool(os.environ.get("RAY_AUTH_TOKEN")) or token_file.is_file()
            if "uthenticat" not in text and "token" not in text.lower() \
                    or os.environ.get("RAY_AUTH_MODE") == "token" or not has_token:
                raise ConfigError("--address", f"cannot connect to the Ray cluster at {address}: "
                                               f"{ANSI.sub('', text)[:500]}. With token authentication set "
                                               "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) "
                                               "to the cluster's token (`ray get-auth-token`).") from None
            log.info("cluster requires token authentication; retrying with RAY_AUTH_MODE=token")
            os.environ["RAY_AUTH_MODE"] = "token"
            ray.shutdown()
            _reload_auth_settings()
            ray.init(address=address, **kwargs)
        return f"cluster at {address}"
    _stay_on_loopback()  # a single-machine instance listens on the loopback interface only
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if "RAY_AUTH_MODE" not in os.environ and (os.environ.get("RAY_AUTH_TOKEN") or token_file.is_file()):
        # Ray would do the same with the token it finds, and print a notice saying so
        os.environ["RAY_AUTH_MODE"] = "token"
        _reload_auth_settings()
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, **kwargs)
    return f"local Ray instance on 127.0.0.1 ({ray.cluster_resources().get('CPU', 0):.0f} CPUs)"


__all__ = ["ANSI", "check_address", "init_ray"]
