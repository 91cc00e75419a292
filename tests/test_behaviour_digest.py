"""Behaviour preservation: fixed small runs compute exactly what they computed before a refactor.

Each config below runs a few rounds; the test hashes every logged metric (as the float's exact
hex), the per-client evaluation table, the newcomers' join result and the final model state
(server and every client, tensors byte for byte) and compares with digests stored here, computed
by the engine before issue 26's rewrite of the simulator. A refactor that changes any draw, any
order of floating-point operations or any byte counted by the ledger changes a digest.

The three configs of the issue (FPFC on S1, SCAFFOLD on digits, FedALA on Fashion-MNIST) are
varied so that they pass through every client-facing path the engine has: sequential and vectorized
cohorts, uplink and downlink compression, an attack, the newcomers' join, evaluation rounds, and
(a fourth) the asynchronous driver.

The digests are of float results, so they hold for this torch build (2.14.1) and for one CPU
vendor and instruction set: the same engine gives other bits on an AMD processor than on the Intel
ones the first digests were recorded on (all four differ; no MKL or ATen instruction-set setting
reproduced them, so the vendor's kernels are the likely cause), and other bits again on an AMD
processor without AVX-512. They are kept per vendor (``/proc/cpuinfo``'s ``vendor_id``) and
instruction set (torch's CPU capability) where that was known; a run must equal one of its vendor's
sets (another set's bits are no refactor's outcome), and the test skips, naming the vendor, on a
processor none was recorded for. A
different torch or BLAS may legitimately round differently too. Recompute them only for such a
reason, never to make a refactor pass: ``python3 tests/test_behaviour_digest.py`` prints the current
ones; add a vendor's only from the commit the others were computed at, so that all describe one engine.
"""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from helpers import small_config  # noqa: E402

FMNIST = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"

CONFIGS = {
    # FPFC on the S1 scenario, scaled down; newcomers join by FPFC's rule after training
    "fpfc_s1": dict(scenario="fpfc_s1", data__num_clients=20, federation__rounds=4, federation__clients_per_round=6,
                    federation__eval_every=2, newcomers__fraction=0.2, newcomers__rounds=3),
    # SCAFFOLD on digits: the batched cohort, compressed uplink and downlink
    "scaffold_digits": dict(method__name="scaffold", federation__rounds=3, federation__cohort="vectorized",
                            compression__uplink={"name": "qsgd", "s": 7},
                            compression__downlink={"name": "topk", "ratio": 0.3}, compression__min_numel=64),
    # FedALA on Fashion-MNIST under a sign-flip attack
    "fedala_fmnist": dict(method__name="fedala", data__source="fmnist", data__max_samples=1200, data__num_clients=6,
                          data__partition__alpha=0.1, model__name="mlp", model__params__hidden=[32],
                          federation__clients_per_round=4, federation__batch_size=50, federation__rounds=3,
                          attack__kind="sign_flip", attack__fraction=0.2),
    # the asynchronous driver (FPFC's asynchronous form)
    "fpfc_async": dict(scenario="fpfc_s1", data__num_clients=12, federation__rounds=3, federation__clients_per_round=4,
                       federation__driver="async", federation__eval_every=1),
}

# (metrics digest, model-state digest), computed before issue 26's refactor; two model-state digests
# recomputed for issue 25's state layout only (stage state under "stages", messages in typed parts):
# mapped back to the old layout, those states hash to the old digests 48c89ebc… and 397db612…
# fedala_fmnist and scaffold_digits recomputed by issue 33, whose weighted_average sums Σ w_k·model_k
# in order and divides by Σ w_k (the running sum a streaming server folds replies into) where it
# took one product with the normalised weights: float rounding only (global models within 7.5e-7,
# metrics within 1e-7 of the earlier run; SCAFFOLD's top-k downlink mirror, which the rounding can
# tip into another selection, within 1.7e-4), every other bit of the four runs unchanged (scaffold_digits'
# state digest: that rounding in issue 25's layout). fedala_fmnist, fpfc_s1 and fpfc_async recomputed once
# more for issue 33's plain SGD step, one fused pass w + (−lr)·g as torch.optim.SGD's foreach step (was
# lr·g then a subtraction, two roundings): float rounding only — every accuracy and loss these runs log
# within 6e-8 of the run before (fedala 6.0e-8, fpfc_s1 1.6e-8, fpfc_async 5.6e-9); scaffold_digits,
# whose cohort steps are batched, unchanged
# AuthenticAMD AVX512: computed at commit 6ff09aa (the engine of the GenuineIntel digests) on an AMD
# EPYC (AVX-512), and unchanged by issue 27's store and data changes. AuthenticAMD AVX2: computed at
# 6ff09aa on an AMD EPYC whose torch reports AVX2 (28 Nov 2026); the engine at 7a71c88 gave the same
DIGESTS = {
    "GenuineIntel": {
        "fedala_fmnist": ("ac9546dd8a8aac9e02194d73", "4c54bad4785a3749c583a2b4"),
        "fpfc_async": ("d9d29c50bc5401a96684559e", "d16a713a2b6b6cfdc6ba9a16"),
        "fpfc_s1": ("1d8948319f0255ac7481e889", "b672d8aa7431bdcffce7d762"),
        "scaffold_digits": ("a8324fa4b238190d045dd849", "c4d855d95e261e4f5881e2d3"),
    },
    "AuthenticAMD AVX512": {
        "fedala_fmnist": ("c6dce4597528261e1377a0a4", "7982f4f43f5cf753a98e4411"),
        "fpfc_async": ("b7b40979484885e2a6532e59", "201161df0bd701f6cd3fce31"),
        "fpfc_s1": ("66043b5651922eabcb285178", "258e58a61fa1f1b85ef2dc82"),
        "scaffold_digits": ("83611ea9590a9974a95ea999", "10d545d48f411b7556ad80b0"),
    },
    "AuthenticAMD AVX2": {
        "fedala_fmnist": ("945d94f25fde8294f34483d3", "aca9ac0d8b641476870b2c41"),
        "fpfc_async": ("3bbb4b4464cb71a515e3004a", "de3be80b048981924e1410bd"),
        "fpfc_s1": ("c900ca9e6fed770ee206fe6a", "a443d48aab09232255d76d4d"),
        "scaffold_digits": ("20166479b62f6c41215b7162", "7b5ab90e53650056786ec29b"),
    },
}


def cpu_vendor() -> str:
    """This processor's vendor as ``/proc/cpuinfo`` names it (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _config(name: str):
    settings = dict(CONFIGS[name])
    scenario = settings.pop("scenario", None)
    if scenario is not None:
        from pfl.tune.space import load_scenario

        base = {k.replace(".", "__"): v for k, v in load_scenario(scenario).items()}
        settings = {**base, "data__partition__kind": "auto", "federation__eval_every": 1, **settings}
        settings.setdefault("method__name", "fpfc")
    settings.setdefault("data__cache", False)
    return small_config(**settings)


def _feed(h, value) -> None:
    """``value`` into the hash, unambiguously (types, keys sorted, floats by their exact bits)."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        h.update(b"{")
        for k in sorted(value, key=repr):
            h.update(repr(k).encode())
            _feed(h, value[k])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for v in value:
            _feed(h, v)
        h.update(b"]")
    elif isinstance(value, float):
        h.update(f"f{value.hex()}".encode())
    elif hasattr(value, "tobytes"):  # numpy arrays and scalars
        h.update(f"N{value.dtype}{getattr(value, 'shape', ())}".encode() + value.tobytes())
    else:
        h.update(f"{type(value).__name__}:{value!r}".encode())


def _digest(value) -> str:
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()[:24]


def run_digests(name: str) -> tuple[str, str]:
    from pfl.federation.loop import RoundLoop
    from pfl.federation.drivers import simulator_for
    from pfl.federation.state import encode

    cfg = _config(name)
    sim = simulator_for(cfg)(cfg)
    loop = RoundLoop(sim, [])
    assert loop.run().status == "FINISHED"
    metrics = {"history": sim.history, "clients": sim.last_client_table, "summary": loop.summary,
               "ledger": sim.ledger.state_dict()}
    return _digest(_unmeasured(metrics)), _digest(_unmeasured(encode(_recorded_layout(sim.model_state()))))


def _recorded_layout(state: dict) -> dict:
    """``state`` in the layout the digests were recorded in: issue 27 moved the compression stage's
    downlink mirrors from its state (``stages.compression.mirrors``) into the client store's memory
    ``compression/mirror`` (``memories``); the tensors are the same. Issue 38 added FPFC's
    ``theta_rowsum``, left out."""
    # FPFC's Dᵀθ at the last residual report (issue 38): new state, a function of θ's history
    server = state.get("server", {})
    if "theta_rowsum" in server:
        state = {**state, "server": {k: v for k, v in server.items() if k != "theta_rowsum"}}
    memories = dict(state.get("memories", {}))
    mirrors = memories.pop("compression/mirror", None)
    if mirrors is None:
        return state
    state = {k: v for k, v in state.items() if k != "memories"}
    if memories:
        state["memories"] = memories
    stages = dict(state.get("stages", {}))
    stages["compression"] = {**stages.get("compression", {}), "mirrors": mirrors}
    state["stages"] = stages
    return state


#: what runs report that they did not when the digests were recorded, left out so that everything
#: else is still compared bit for bit (issue 38: FPFC's ADMM residuals every round, the validation
#: estimate's standard error and each client's validation count)
ADDED_SINCE = frozenset({"fpfc/primal_residual", "fpfc/dual_residual", "fpfc/primal_scale", "fpfc/dual_scale",
                         "fpfc/glued_clusters", "val/acc_se", "val/rmse_se", "n_val"})


def _unmeasured(value):
    """``value`` without wall-clock durations (they differ between runs; the simulated clock stays)
    and without the keys added since the digests were recorded."""
    if isinstance(value, dict):
        return {k: _unmeasured(v) for k, v in value.items()
                if not (isinstance(k, str) and ("time" in k or "seconds" in k) and k != "time/sim_clock")
                and k not in ADDED_SINCE and not (isinstance(k, str) and k.startswith("test/trained/"))}
    if isinstance(value, (list, tuple)):
        return type(value)(_unmeasured(v) for v in value)
    return value


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_fixed_run_computes_what_it_computed_before_the_refactor(name):
    if CONFIGS[name].get("data__source") == "fmnist" and not os.path.exists(FMNIST):
        pytest.skip("Fashion-MNIST files not installed (setup.sh installs them)")
    vendor = cpu_vendor()
    recorded = [digests[name] for key, digests in DIGESTS.items() if key.split()[0] == vendor]
    if not recorded:
        pytest.skip(f"no digests recorded for {vendor or 'this'} processor (recorded: {', '.join(DIGESTS)})")
    assert run_digests(name) in recorded


if __name__ == "__main__":
    print(f"    {cpu_vendor() + ' ' + torch.backends.cpu.get_cpu_capability()!r}: {{")
    for key in sorted(CONFIGS):
        print(f"    {key!r}: {run_digests(key)!r},")
