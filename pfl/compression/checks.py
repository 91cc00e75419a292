"""Config checks that need both the method and the ``compression`` section (run by
:func:`pfl.resolver.resolve`, before any data is loaded)."""

from __future__ import annotations

from ..schema import ConfigError
from .compressors import COMPRESSORS, build


def unbiased_names() -> list[str]:
    """Compressor names that are unbiased with their default parameters (randk: with scale=true)."""
    return ["none"] + [n for n, cls in COMPRESSORS.items() if cls.unbiased is True or n == "randk"]


def check_method_compression(cfg, method) -> None:
    """``cfg.compression`` against the class of ``cfg.method`` (``method``)."""
    own = method.compresses_uplink
    if not own:
        return
    comp = cfg.compression
    if comp.error_feedback:
        raise ConfigError("compression.error_feedback",
                          f"{cfg.method.name} compresses its uplink inside its own protocol "
                          f"({method.description}); error feedback does not apply to it — set it to false")
    if own == "unbiased":
        built = build(comp.uplink)
        if built is not None and not built.unbiased:
            detail = comp.uplink["name"] == "randk"
            raise ConfigError("compression.uplink.name",
                              f"{cfg.method.name} needs an unbiased compressor (its step sizes use ω), got "
                              f"{comp.uplink['name']!r}{' with scale=false' if detail else ''}; allowed values: "
                              f"{', '.join(unbiased_names())} (randk with scale=true)")


__all__ = ["check_method_compression", "unbiased_names"]
