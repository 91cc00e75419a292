"""pfl: personalized federated learning experiments (simulation, tracking, tuning).

Importing ``pfl`` has no side effects; the pieces live in submodules:
``pfl.config`` (experiment config), ``pfl.data``, ``pfl.models``, ``pfl.methods``,
``pfl.federation`` (simulator, messages), ``pfl.tracking`` (MLflow), ``pfl.runner``.
"""

__version__ = "0.1.0"
