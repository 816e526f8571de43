"""Zero-bubble weight-gradient deferral: inside `store.defer()` linear layers compute only the
input (and bias) gradients and leave their weight GEMMs in the store; computing them later gives
exactly autograd's weight gradients."""
import torch

from megazero.runtime import comm
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megazero.tensor_parallel.weight_grad import WeightGradStore, defer_linears


def test_deferred_weight_grads_equal_autograd():
    g = comm.single_rank_group("tp")
    torch.manual_seed(0)
    store = WeightGradStore()
    layers = torch.nn.Sequential(ColumnParallelLinear(8, 16, g, name="a", wgrad_store=store), torch.nn.GELU(),
                                 RowParallelLinear(16, 8, g, name="b", wgrad_store=store))
    x = torch.randn(5, 3, 8, requires_grad=True)
    layers(x).square().sum().backward()
    ref = {n: p.grad.clone() for n, p in layers.named_parameters()}
    ref_x = x.grad.clone()
    layers.zero_grad(set_to_none=True)
    x.grad = None

    with store.defer():
        layers(x).square().sum().backward()
    pending = store.take()
    assert len(pending) == 2 and store.take() == []
    assert layers[0].weight.grad is None and layers[2].weight.grad is None  # deferred
    assert torch.allclose(layers[0].bias.grad, ref["0.bias"], rtol=1e-6, atol=0)  # computed in B
    # fp32: the same matmuls split into input and weight parts, summed in another order: ~10 ulps; atol for near-0 entries
    assert torch.allclose(x.grad, ref_x, rtol=1e-6, atol=1e-7)
    for entry in pending:
        weight, gw = WeightGradStore.compute(entry)
        name = "0.weight" if weight is layers[0].weight else "2.weight"
        # fp32: a weight gradient sums over the batch (more terms than the input's), so ~100 ulps relative; atol for near-0 entries
        assert torch.allclose(gw, ref[name], rtol=1e-5, atol=1e-6)
    # without defer(), the same layers accumulate weight grads as usual
    layers.zero_grad(set_to_none=True)
    layers(x).square().sum().backward()
    # fp32: a weight gradient sums over the batch (more terms than the input's), so ~100 ulps relative; atol for near-0 entries
    assert torch.allclose(layers[2].weight.grad, ref["2.weight"], rtol=1e-5, atol=1e-6)


def test_defer_linears_routes_plain_nn_linear_and_leaves_the_rest_alone():
    """After defer_linears, under defer() an nn.Linear's backward yields the input and bias gradients but
    no weight gradient; the store holds one entry per linear whose GEMM (compute, or add_into a slot)
    gives autograd's weight gradient. Outside defer() the routed linear computes it at once. A subclass
    of nn.Linear is left alone."""
    torch.manual_seed(0)

    class Custom(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3), Custom(3, 2))
    x = torch.randn(4, 2, 6, requires_grad=True)
    params = [x, model[0].weight, model[0].bias, model[2].weight, model[3].weight]
    ref = torch.autograd.grad(model(x).sum(), params)
    store = WeightGradStore()
    assert defer_linears(model, store) == 2
    with store.defer():
        gx, gw0, gb0, gw2, gw3 = torch.autograd.grad(model(x).sum(), params, allow_unused=True)
    assert gw0 is None and gw2 is None  # deferred
    entries = store.take()
    assert [e[0] for e in entries] == [model[2].weight, model[0].weight]  # in backward order
    torch.testing.assert_close(gx, ref[0])
    torch.testing.assert_close(gb0, ref[2])
    torch.testing.assert_close(gw3, ref[4])  # the subclass computed its own
    deferred = {id(w): g for w, g in (WeightGradStore.compute(e) for e in entries)}
    torch.testing.assert_close(deferred[id(model[0].weight)], ref[1])
    slot = torch.ones_like(model[2].weight)
    WeightGradStore.add_into(entries[0], slot)
    torch.testing.assert_close(slot, ref[3] + 1)
    again = torch.autograd.grad(model(x).sum(), params)  # not deferring: every gradient at once
    for a, b in zip(again, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_routed_linear_skips_frozen_weights_and_runs_autocast_natively():
    """A frozen weight gets no GEMM and no deferred entry (so W never looks it up); under autocast the
    routed linear is torch's own (autocast casts inside F.linear), and trains as before."""
    torch.manual_seed(0)
    frozen, trained = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)
    frozen.weight.requires_grad_(False)
    model = torch.nn.Sequential(frozen, trained)
    store = WeightGradStore()
    defer_linears(model, store)
    x = torch.randn(3, 4)
    with store.defer():
        model(x).sum().backward()
    entries = store.take()
    assert [e[0] for e in entries] == [trained.weight] and frozen.weight.grad is None
    assert frozen.bias.grad is not None  # the frozen layer's bias still trains
    with torch.autocast("cpu", dtype=torch.bfloat16), store.defer():
        out = model(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert store.take() == [] and trained.weight.grad is not None
