"""What a round costs: the mean folded in as replies arrive, robust rules keeping them all, the local
loop on the module itself, minibatches as slices of a shuffled copy. Each is compared with a
computation written another way (a closed form, the mean of the replies as delivered, the
functional call, the per-step gather)."""

import torch
from torch.func import functional_call

from helpers import small_config
from pfl.aggregation import WeightedSum, weighted_average
from pfl.callbacks.divergence import run_rounds
from pfl.federation.simulator import Simulator
from pfl.models import build_model, params_of
from pfl.training import batch_indices, batches, local_sgd


def test_weighted_sum_is_the_weighted_mean_by_hand():
    acc = WeightedSum()
    acc.add({"a": torch.tensor([1.0, 2.0]), "n": torch.tensor([4])}, 1.0)
    acc.add({"a": torch.tensor([4.0, 8.0]), "n": torch.tensor([7])}, 3.0)
    mean = acc.mean()
    # (1·[1, 2] + 3·[4, 8]) / 4 = [13/4, 26/4]; integers: (4 + 21) / 4 = 6.25, truncated as a cast does
    assert torch.equal(mean["a"], torch.tensor([3.25, 6.5]))
    assert mean["n"].dtype == torch.int64 and int(mean["n"]) == 6
    models = [{"w": torch.randn(5, 3)} for _ in range(4)]
    by_hand = sum(m["w"].double() * w for m, w in zip(models, (1, 2, 3, 4))) / 10
    assert torch.allclose(weighted_average(models, [1, 2, 3, 4])["w"].double(), by_hand, atol=1e-6)


def _recording(sim):
    """The delivered replies as the server's receive saw them, and what aggregate was given."""
    seen, given = {}, []
    receive, aggregate = sim.method.receive, sim.method.aggregate

    def record_receive(rnd, cid, reply):
        seen[cid] = ({k: v.clone() for k, v in reply.params().items()}, reply.info["n"])
        return receive(rnd, cid, reply)

    def record_aggregate(rnd, replies):
        given.append({cid: len(r.parts) for cid, r in replies.items()})
        return aggregate(rnd, replies)

    sim.method.receive, sim.method.aggregate = record_receive, record_aggregate
    return seen, given


def test_fedavg_folds_each_reply_into_a_running_sum_and_keeps_none():
    sim = Simulator(small_config(federation__rounds=1))
    seen, given = _recording(sim)
    run_rounds(sim)
    assert len(seen) == 5 and given == [{cid: 0 for cid in seen}]   # aggregate got control data only
    total = sum(n for _, n in seen.values())
    for k, t in sim.method.global_model.items():    # Σ n_k w_k / Σ n_k in float64 from the delivered replies
        mean = sum(m[k].double() * n for m, n in seen.values()) / total
        assert torch.allclose(t.double(), mean, atol=1e-6), k


def test_a_robust_rule_and_an_aggregate_override_keep_every_reply():
    median = Simulator(small_config(federation__rounds=1, method__aggregator="median"))
    _, given = _recording(median)
    run_rounds(median)
    assert all(n > 0 for n in given[0].values())
    # SCAFFOLD overrides aggregate without declaring that it only averages: no folding
    scaffold = Simulator(small_config(federation__rounds=1, method__name="scaffold"))
    assert not scaffold.method.streaming()
    assert Simulator(small_config(method__name="fedadam")).method.streaming()


def test_the_module_path_trains_bit_for_bit_as_the_functional_call_and_leaves_the_module_alone():
    torch.manual_seed(0)
    model = build_model("cnn_fedavg", {"channels": [4, 8], "hidden": 16}, (1, 28, 28), 10)
    before = params_of(model)
    x, y = torch.rand(37, 1, 28, 28), torch.randint(0, 10, (37,))
    start = {k: v + 0.01 for k, v in before.items()}
    kw = dict(lr=0.1, epochs=2, batch_size=8)
    module = local_sgd(model, start, x, y, generator=torch.Generator().manual_seed(3), **kw)
    functional = local_sgd(model, start, x, y, generator=torch.Generator().manual_seed(3),
                           forward=lambda p, xb: functional_call(model, p, (xb,)), **kw)
    assert module.steps == functional.steps == 10
    assert all(torch.equal(module.params[k], functional.params[k]) for k in start)
    assert all(not torch.equal(module.params[k], start[k]) for k in start)
    assert all(torch.equal(p, before[k]) and p.requires_grad for k, p in model.named_parameters())
    # a subset of trainable names: the rest is carried over unchanged, the module still untouched
    head = local_sgd(model, start, x, y, generator=torch.Generator().manual_seed(3), trainable=["fc.weight"], **kw)
    assert not torch.equal(head.params["fc.weight"], start["fc.weight"])
    assert all(torch.equal(head.params[k], start[k]) for k in start if k != "fc.weight")
    assert all(torch.equal(p, before[k]) and p.requires_grad for k, p in model.named_parameters())


def test_minibatches_are_the_same_samples_as_the_per_step_gather():
    x, y = torch.arange(23.0).reshape(23, 1), torch.arange(23)
    for bs, epochs, steps in ((5, 2, None), (5, 1, 7), (0, 3, None), (30, 1, 2)):
        gathered = [(x, y) if idx is None else (x[idx], y[idx])
                    for idx in batch_indices(23, bs, epochs, steps, torch.Generator().manual_seed(1), x.device)]
        sliced = list(batches(x, y, bs, epochs, steps, torch.Generator().manual_seed(1)))
        assert len(sliced) == len(gathered)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(sliced, gathered))


def test_a_trained_model_the_client_did_not_keep_goes_up_without_a_copy_and_a_kept_one_is_copied():
    from helpers import downlink, uplink

    for name, handed in (("fedavg", True), ("fpfc", False)):
        sim = Simulator(small_config(method__name=name, federation__rounds=1))
        produced = {}
        local_update = sim.client_role.local_update

        def recording(rnd, client, msg, local_update=local_update, produced=produced):
            reply = local_update(rnd, client, msg)
            produced.update(reply.params())
            return reply

        object.__setattr__(sim.client_role, "local_update", recording)
        sim.method.begin_round(0, [0])
        reply = uplink(sim, 0, downlink(sim, 0))
        delivered = reply.params()
        same_objects = [delivered[k] is produced[k] for k in produced]
        assert all(same_objects) if handed else not any(same_objects), name
        if not handed:  # FPFC keeps its w: the server's copy shares no storage with it
            kept = {t.untyped_storage().data_ptr() for t in sim.client_states[0]["w"].values()}
            assert not kept & {t.untyped_storage().data_ptr() for t in delivered.values()}
