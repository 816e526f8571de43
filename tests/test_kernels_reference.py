"""The reference twins (megazero.runtime.kernels.reference) against float64 computations written out by hand.

fp32 twins: outputs and gradients within rtol 1e-5 / atol 1e-6 of float64 (reduction rounding over <= 512
elements). 16-bit inputs: the twin computes in fp32 and rounds once, so it lies within one unit in the last
place of the 16-bit result (rtol 2^-8 for bf16, 2^-11 for fp16) of float64.
"""
import math

import pytest
import torch

from megazero.runtime.kernels import reference

# sizes: the module docstring (fp32 reduction rounding over <= 512 elements against float64)
F64_TOL = dict(rtol=1e-5, atol=1e-6)
# one ulp of the 16-bit result: 2^-8 bf16 (8-bit mantissa), 2^-11 fp16 (11-bit), the module docstring
HALF_TOL = {torch.bfloat16: dict(rtol=2.0**-8, atol=1e-6), torch.float16: dict(rtol=2.0**-11, atol=1e-6)}


def ln64(x, w, b, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt(var + eps) * w
    return y if b is None else y + b


def rms64(x, w, eps):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * w


def softmax64(z):
    e = torch.exp(z - z.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def grads_of(fn, inputs, seed=1):
    """(output, grads of <output, fixed random weights> w.r.t. inputs)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    (out.double() * probe).sum().backward()
    return out, [t.grad for t in leaves]


@pytest.mark.parametrize("cols", [2, 8, 33, 512])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_fp32_matches_float64(cols, with_bias):
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(4, 3, cols, generator=gen) * 3 + 1
    w, b = torch.randn(cols, generator=gen), torch.randn(cols, generator=gen)
    inputs = [x, w, b] if with_bias else [x, w]
    out, grads = grads_of(lambda *t: reference.layer_norm(t[0], t[1], t[2] if with_bias else None, 1e-5), inputs)
    ref, ref_grads = grads_of(lambda *t: ln64(t[0], t[1], t[2] if with_bias else None, 1e-5),
                              [t.double() for t in inputs])
    torch.testing.assert_close(out, ref.float(), **F64_TOL)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r.float(), **F64_TOL)


def test_layer_norm_of_one_column_is_the_bias():
    """var = 0: the output is exactly b; its fp32 gradients are cancellation noise times 1/sqrt(eps), untested."""
    x, w, b = torch.randn(6, 1), torch.randn(1), torch.randn(1)
    # x - mean is exactly 0 for one column, so the output is b up to fp32 rounding of b itself (|b| ~ 1: ~1e-7)
    torch.testing.assert_close(reference.layer_norm(x, w, b), b.expand(6, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("cols", [1, 33, 512])
def test_rms_norm_fp32_matches_float64(cols):
    gen = torch.Generator().manual_seed(cols)
    x, w = torch.randn(5, cols, generator=gen), torch.randn(cols, generator=gen)
    out, grads = grads_of(lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w])
    ref, ref_grads = grads_of(lambda a, b: rms64(a, b, 1e-6), [x.double(), w.double()])
    torch.testing.assert_close(out, ref.float(), **F64_TOL)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r.float(), **F64_TOL)


def test_norms_over_several_trailing_dims():
    x, w, b = torch.randn(3, 4, 5), torch.randn(4, 5), torch.randn(4, 5)
    flat = reference.layer_norm(x.view(3, 20), w.view(20), b.view(20))
    torch.testing.assert_close(reference.layer_norm(x, w, b), flat.view(3, 4, 5))
    torch.testing.assert_close(reference.rms_norm(x, w), reference.rms_norm(x.view(3, 20), w.view(20)).view(3, 4, 5))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_norms_round_the_fp32_statistics_result_once(dtype):
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(6, 96, generator=gen), torch.randn(96, generator=gen), torch.randn(96, generator=gen)
    x16 = x.to(dtype)
    exact = ln64(x16.double(), w.double(), b.double(), 1e-5)
    out = reference.layer_norm(x16, w, b)  # fp32 weight with 16-bit x: the mixed-precision case
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), exact, **HALF_TOL[dtype])
    out = reference.rms_norm(x16, w.to(dtype))
    torch.testing.assert_close(out.double(), rms64(x16.double(), w.to(dtype).double(), 1e-5), **HALF_TOL[dtype])


def masked_softmax64(x, mask, scale):
    z = x * scale
    if mask is not None:
        z = torch.where(mask, torch.full_like(z, reference.MASKED_SCORE), z)
    return softmax64(z)


@pytest.mark.parametrize("mask_batches", [0, 1, 2])  # 0: no mask
def test_scaled_masked_softmax_matches_float64(mask_batches):
    gen = torch.Generator().manual_seed(mask_batches)
    x = torch.randn(2, 3, 5, 37, generator=gen)
    mask = None if mask_batches == 0 else torch.rand(mask_batches, 1, 5, 37, generator=gen) < 0.3
    fn = lambda s: reference.scaled_masked_softmax(s, mask, 0.125)  # noqa: E731
    out, (g,) = grads_of(fn, [x])
    ref, (rg,) = grads_of(lambda s: masked_softmax64(s, mask, 0.125), [x.double()])
    torch.testing.assert_close(out, ref.float(), **F64_TOL)
    torch.testing.assert_close(g, rg.float(), **F64_TOL)
    if mask is not None:
        assert (g.masked_select(mask.expand_as(g)) == 0).all()  # masked scores get no gradient


def test_fully_masked_row_is_uniform_not_nan():
    x = torch.randn(1, 1, 2, 8)
    mask = torch.zeros(1, 1, 2, 8, dtype=torch.bool)
    mask[0, 0, 1] = True
    y = reference.scaled_masked_softmax(x, mask, 1.0)
    torch.testing.assert_close(y[0, 0, 1], torch.full((8,), 1 / 8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_softmax_rounds_once(dtype):
    x = torch.randn(2, 2, 8, 40, generator=torch.Generator().manual_seed(3)).to(dtype)
    mask = torch.rand(1, 1, 8, 40, generator=torch.Generator().manual_seed(4)) < 0.2
    out = reference.scaled_masked_softmax(x, mask, 0.3)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), masked_softmax64(x.double(), mask, 0.3), **HALF_TOL[dtype])


@pytest.mark.parametrize("seq", [1, 7, 64])
def test_causal_softmax_matches_float64(seq):
    gen = torch.Generator().manual_seed(seq)
    x = torch.randn(2, 3, seq, seq, generator=gen)
    above = torch.ones(seq, seq, dtype=torch.bool).triu(1)

    def exact(s):
        return softmax64(torch.where(above, torch.full_like(s, -math.inf), s * 0.5))

    out, (g,) = grads_of(lambda s: reference.scaled_upper_triang_masked_softmax(s, 0.5), [x])
    ref, (rg,) = grads_of(exact, [x.double()])
    torch.testing.assert_close(out, ref.float(), **F64_TOL)
    torch.testing.assert_close(g, rg.float(), **F64_TOL)
    assert (out[..., above] == 0).all() and (g[..., above] == 0).all()


def test_softmax_backward_formula_is_the_autograd_gradient():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 2, 6, 6, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 2, 6, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(1, 1, 6, 6, generator=gen) < 0.3
    for fn, masked in ((lambda s: reference.scaled_masked_softmax(s, mask, 0.8), mask),
                       (lambda s: reference.scaled_upper_triang_masked_softmax(s, 0.8), reference.causal_mask(6, 6))):
        leaf = x.clone().requires_grad_()
        y = fn(leaf)
        y.backward(dy)
        # float64 on both sides, the closed form vs autograd's ops in another order: ~1e-16 per op, 1e-12 with margin
        torch.testing.assert_close(reference.softmax_backward(y.detach(), dy, masked, 0.8), leaf.grad,
                                   rtol=1e-12, atol=1e-12)


def test_adam_twin_fp32_matches_float64():
    """fp32 vs exact: each of the 100 steps rounds p by at most 2^-24 of its scale."""
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
    for adamw in (True, False):
        runs = {}
        for dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(0)
            p = torch.randn(1000, generator=gen).to(dtype)
            m, v = torch.zeros_like(p), torch.zeros_like(p)
            for step in range(1, 101):
                g = torch.randn(1000, generator=gen).to(dtype)
                reference.adam_step(p, g, m, v, step=step, adamw_mode=adamw, bias_correction=True, **hyper)
            runs[dtype] = p
        exact = runs[torch.float64]
        torch.testing.assert_close(runs[torch.float32], exact.float(), rtol=0,
                                   atol=100 * 2.0**-24 * float(exact.abs().max()))


def test_adam_twin_is_adam_in_float64():
    """The twin's update, written out as the textbook formula in float64 (one step from non-zero state)."""
    gen = torch.Generator().manual_seed(5)
    p, g, m, v = (torch.randn(50, generator=gen, dtype=torch.float64) for _ in range(4))
    v = v.abs()
    lr, b1, b2, eps, wd, step = 1e-2, 0.8, 0.95, 1e-6, 0.1, 3
    for adamw in (True, False):
        pp, mm, vv = p.clone(), m.clone(), v.clone()
        reference.adam_step(pp, g, mm, vv, step=step, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                            adamw_mode=adamw, bias_correction=True)
        gg = g if adamw else g + wd * p
        m1, v1 = b1 * m + (1 - b1) * gg, b2 * v + (1 - b2) * gg * gg
        upd = (m1 / (1 - b1**step)) / (torch.sqrt(v1 / (1 - b2**step)) + eps)
        p1 = (p * (1 - lr * wd) if adamw else p) - lr * upd
        # float64 on both sides, the same formula in another order of operations: ~1e-16 per op, 1e-12 with margin
        torch.testing.assert_close(pp, p1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mm, m1, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(vv, v1, rtol=1e-12, atol=1e-12)


def test_every_op_has_documented_tolerances():
    for op in ("layer_norm", "rms_norm", "softmax", "softmax_backward"):
        assert set(reference.TOLERANCES[op]) == {torch.float32, torch.bfloat16, torch.float16}
    assert torch.float32 in reference.TOLERANCES["adam"]
