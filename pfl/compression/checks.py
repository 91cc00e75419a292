"""Everything the ``compression`` section is checked against, in one place (run by
:func:`pfl.resolver.resolve`, before any data is loaded): each compressor's own parameters
(:func:`~pfl.compression.compressors.resolve_spec`, its ``Params`` dataclass) and what the
compressors, error feedback and the method need of each other."""

from __future__ import annotations

from ..schema import ConfigError
from .compressors import COMPRESSORS, build, resolve_spec

#: downlink compressors after which a client holds exactly what the server sent
EXACT = ("none", "identity")


def unbiased_names() -> list[str]:
    """Compressor names that are unbiased with their default parameters (randk: with scale=true)."""
    return ["none"] + [n for n, cls in COMPRESSORS.items() if cls.unbiased is True or n == "randk"]


def resolve_compression(comp) -> None:
    """``compression.uplink`` / ``.downlink`` validated into their full parameter sets, in place."""
    comp.uplink = resolve_spec(comp.uplink, "compression.uplink")
    comp.downlink = resolve_spec(comp.downlink, "compression.downlink")


def check_method_compression(cfg, method) -> None:
    """``cfg.compression`` against itself and the class of ``cfg.method`` (``method``)."""
    comp = cfg.compression
    up, down = build(comp.uplink), build(comp.downlink)
    # a replica (downlink) or a memory (error feedback) follows e⁺ = (e + Δ) − C'(e + Δ); it stays
    # bounded for a contractive C' (C itself, or C/(1+ω) for an unbiased C), never for plain sign
    if down is not None and not (down.unbiased or down.contractive):
        raise ConfigError("compression.downlink.scaled",
                          f"{comp.downlink.name} with scaled=false is neither unbiased nor contractive, so the "
                          "clients' copies would drift from the model; use scaled=true")
    if comp.error_feedback and up is not None and not (up.unbiased or up.contractive):
        raise ConfigError("compression.uplink.scaled",
                          f"error feedback needs a contractive compressor; {comp.uplink.name} with scaled=false "
                          "is not (its memory grows): use scaled=true")
    if comp.error_feedback and up is not None and up.unbiased and up.omega(1 << 20) > 0:
        # stable only as C/(1+ω), whose memory holds about ω rounds of updates back (measured: rand-k
        # 10 % + EF 29 % after 30 digits rounds, rand-k alone 89 %); an unbiased C needs no memory
        raise ConfigError("compression.error_feedback",
                          f"{comp.uplink.name} is unbiased and needs no error feedback (with it the memory grows "
                          "unless the compressor is scaled by 1/(1+ω), which holds every update back by about ω "
                          "rounds); set error_feedback=false, or use a biased compressor (topk, sign, randk with "
                          "scale=false, fp16, bf16)")
    if comp.downlink.name not in EXACT and method.exact_downlink:
        raise ConfigError("compression.downlink.name",
                          f"{cfg.method.name} needs every client to hold exactly what the server holds "
                          f"({method.exact_downlink}); a lossy downlink would make the copies differ. "
                          f"Allowed values: {', '.join(EXACT)}")
    own = method.compresses_uplink
    if not own:
        return
    if comp.error_feedback:
        raise ConfigError("compression.error_feedback",
                          f"{cfg.method.name} compresses its uplink inside its own protocol "
                          f"({method.description}); error feedback does not apply to it — set it to false")
    if own == "unbiased" and up is not None and not up.unbiased:
        detail = comp.uplink.name == "randk"
        raise ConfigError("compression.uplink.name",
                          f"{cfg.method.name} needs an unbiased compressor (its step sizes use ω), got "
                          f"{comp.uplink.name!r}{' with scale=false' if detail else ''}; allowed values: "
                          f"{', '.join(unbiased_names())} (randk with scale=true)")


__all__ = ["EXACT", "check_method_compression", "resolve_compression", "unbiased_names"]
