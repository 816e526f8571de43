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


def test_capture_defers_a_user_nn_linear_and_leaves_the_rest_alone():
    """Under capture() + defer(), an nn.Linear's backward yields the input and bias gradients but no
    weight gradient; the store holds one entry whose GEMM gives autograd's weight gradient. A linear of
    a non-parameter weight, and code outside the context, run as usual."""
    torch.manual_seed(0)
    lin, other = torch.nn.Linear(6, 5), torch.nn.Linear(5, 3)
    x = torch.randn(4, 2, 6, requires_grad=True)
    plain_w = torch.randn(4, 3)  # a plain tensor, not a parameter: never deferred
    ref = torch.nn.functional.linear(other(lin(x)), plain_w)
    ref_grads = torch.autograd.grad(ref.sum(), [x, lin.weight, lin.bias, other.weight])
    store = WeightGradStore()
    with store.capture():
        out = torch.nn.functional.linear(other(lin(x)), plain_w)
    with store.defer(), store.capture():
        gx, gw, gb, gw2 = torch.autograd.grad(out.sum(), [x, lin.weight, lin.bias, other.weight], allow_unused=True)
    assert gw is None and gw2 is None  # both parameter weights were deferred
    deferred = dict((id(w), g) for w, g in (WeightGradStore.compute(e) for e in store.take()))
    assert set(deferred) == {id(lin.weight), id(other.weight)}
    torch.testing.assert_close(gx, ref_grads[0])
    torch.testing.assert_close(gb, ref_grads[2])
    torch.testing.assert_close(deferred[id(lin.weight)], ref_grads[1])
    torch.testing.assert_close(deferred[id(other.weight)], ref_grads[3])
    y = lin(x)  # outside the context: autograd's own linear
    assert "_Linear" not in type(y.grad_fn).__name__
