"""Ray is quiet about what pfl ships on purpose (issue 41, item 6).

Ray 2.60 (``ray._private.runtime_env.packaging``) warns about every file of 10 MiB or more that it
zips into a runtime_env package, advising to exclude it. About the data set pfl stages for a sweep
that advice is wrong; pfl drops the warning for its own staging folders and says once, in its own
words, that the data goes with the sweep. Nothing here starts Ray: the package is zipped by Ray's
own packaging code, with the logger ``ray.init`` hands it.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace


ADVICE = ("Consider adding this file to the 'excludes' list", "approaching the maximum upload size")


def test_ray_is_quiet_about_the_data_pfl_ships_on_purpose(tmp_path, monkeypatch):
    from ray._private.runtime_env.packaging import create_package

    from pfl.tune.runtime_env import worker_runtime_env

    data = tmp_path / "big.parquet"
    data.write_bytes(bytes(11 * 2**20))  # never parsed: shipped as it is
    cfg = SimpleNamespace(plugins=[], model=SimpleNamespace(name="mlp"),
                          data=SimpleNamespace(params={"path": str(data)}))
    shipped = worker_runtime_env([cfg])
    assert shipped.notes == ["data.params.path (11 MiB) goes to every Ray node with the sweep, on purpose: zipped "
                             "and uploaded once per content, unpacked on each node"]
    other = tmp_path / "not_pfls"
    other.mkdir()
    (other / "big.bin").write_bytes(bytes(11 * 2**20))
    # Ray's second warning, about a zipped package of 256 MiB or more, here at any size
    monkeypatch.setenv("RAY_PACKAGE_SIZE_WARNING_MIB", "0")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ray._private.worker")  # the logger ray.init hands to the packaging code
    logger.addHandler(handler)
    try:
        for i, folder in enumerate([shipped.runtime_env["py_modules"][-1], str(other)]):
            create_package(folder, tmp_path / f"package{i}.zip", include_gitignore=True, logger=logger)
    finally:
        logger.removeHandler(handler)
    said = [r.getMessage() for r in records]
    for advice in ADVICE:  # each warning once: about the folder that is not pfl's
        about = [text for text in said if advice in text]
        assert len(about) == 1 and str(other) in about[0], (advice, said)
