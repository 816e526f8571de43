"""Zero-bubble weight-gradient deferral: inside `store.defer()` linear layers compute only the
input (and bias) gradients and leave their weight GEMMs in the store; computing them later gives
exactly autograd's weight gradients."""
import torch

from megazero.runtime import comm
from megazero.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megazero.tensor_parallel.weight_grad import WeightGradStore


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
    assert torch.allclose(x.grad, ref_x, rtol=1e-6, atol=1e-7)
    for entry in pending:
        weight, gw = WeightGradStore.compute(entry)
        name = "0.weight" if weight is layers[0].weight else "2.weight"
        assert torch.allclose(gw, ref[name], rtol=1e-5, atol=1e-6)
    # without defer(), the same layers accumulate weight grads as usual
    layers.zero_grad(set_to_none=True)
    layers(x).square().sum().backward()
    assert torch.allclose(layers[2].weight.grad, ref["2.weight"], rtol=1e-5, atol=1e-6)
