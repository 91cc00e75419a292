import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_stores(tmp_path, monkeypatch):
    """Every test gets its own MLflow store and partition cache (never the user's)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("PFL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PFL_ARTIFACT_ROOT", raising=False)
    yield
