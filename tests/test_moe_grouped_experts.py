"""The routed experts as one grouped GEMM per weight (megazero.moe.experts.GroupedExperts) against a loop
over the experts (each its rows through F.linear, as megazero ran them before), and the padded
batched-matmul fallback likewise: outputs and every gradient as accurate as the loop's, both measured
against the loop in fp64 (within 4x the loop's own error, or 4 fp32 ulps of the tensor's largest value:
the kernels sum in different orders, and which order a CPU's GEMM takes depends on the CPU), with an expert
that gets no row, with rows past the counts (the dropped assignments at ep = 1: zero output, zero
gradient, whatever `torch._grouped_mm` leaves there), with and without biases, SwiGLU and GeLU.
The grouped path waits for the device nowhere (forward and backward); the fallback once, for the
largest count, unless the caller knows the counts."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.moe.experts import HAS_GROUPED_MM, GroupedExperts
from megazero.runtime.sync_counter import SyncCounter

H, FFN, LOCAL = 16, 12, 4
COUNTS = [5, 0, 9, 3]  # expert 1 gets no row
EXTRA = 3  # rows past the counts


def _experts(activation: str, bias: bool) -> GroupedExperts:
    ex = GroupedExperts(H, FFN, activation, 8, LOCAL, 1, "layers.0.mlp.experts", seed=3, std=0.2, out_std=0.2,
                        bias=bias)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in ex.named_parameters():
            if n.endswith("_bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return ex


def _loop(ex: GroupedExperts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert by expert, rows past the counts zero."""
    def b(name, e):
        bias = getattr(ex, f"{name}_bias")
        return None if bias is None else bias[e]

    outs = []
    for e, part in enumerate(rows[:sum(counts)].split(counts)):
        if ex.activation == "swiglu":
            y = F.linear(F.silu(F.linear(part, ex.gate[e], b("gate", e))) * F.linear(part, ex.up[e], b("up", e)),
                         ex.down[e], b("down", e))
        else:
            y = F.linear(F.gelu(F.linear(part, ex.fc1[e], b("fc1", e))), ex.fc2[e], b("fc2", e))
        outs.append(y)
    tail = rows[sum(counts):]
    return torch.cat(outs + [tail.new_zeros(tail.shape)])


def _run(ex, fn, extra: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(sum(COUNTS) + extra, H, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(rows.shape[0], H, generator=g).to(dtype)
    for p in ex.parameters():
        p.grad = None
    with SyncCounter() as syncs:
        out = fn(rows)
        out.backward(grad)
    return out.detach(), rows.grad, {n: p.grad.clone() for n, p in ex.named_parameters()}, syncs


def _as_accurate(got: torch.Tensor, loop: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """`got` (fp32) is as close to the fp64 `exact` as the fp32 loop is: within 4x the loop's largest error,
    or 4 ulps of the largest value when the loop happens to be closer than that."""
    ulp = torch.finfo(torch.float32).eps * exact.abs().max().item()
    loop_err = (loop.double() - exact).abs().max().item()
    err = (got.double() - exact).abs().max().item()
    assert err <= 4 * max(loop_err, ulp), f"{what}: error {err:.3g}, the loop's {loop_err:.3g}, ulp {ulp:.3g}"


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no torch._grouped_mm")
@pytest.mark.parametrize("path", ["grouped", "padded"])
@pytest.mark.parametrize("activation,bias", [("swiglu", False), ("swiglu", True), ("gelu", True), ("gelu", False)])
@pytest.mark.parametrize("extra", [0, EXTRA])
def test_grouped_and_padded_equal_the_loop(monkeypatch, path, activation, bias, extra):
    ex = _experts(activation, bias)
    rows = torch.zeros(1, H)
    assert ex.grouped(rows)  # fp32, 16-byte strides: the grouped GEMM unless forced below
    if path == "padded":
        monkeypatch.setattr(GroupedExperts, "grouped", lambda self, rows: False)
    counts = torch.tensor(COUNTS)
    got, got_x, got_w, syncs = _run(ex, lambda r: ex(r, counts, padded=extra > 0), extra)
    want, want_x, want_w, _ = _run(ex, lambda r: _loop(ex, r, COUNTS), extra)
    exact = _experts(activation, bias).double()  # the same values (same seeds), in fp64
    ref, ref_x, ref_w, _ = _run(exact, lambda r: _loop(exact, r, COUNTS), extra, torch.float64)
    _as_accurate(got, want, ref, "output")
    _as_accurate(got_x, want_x, ref_x, "input grad")
    for n in want_w:
        _as_accurate(got_w[n], want_w[n], ref_w[n], n)
    if extra:  # rows past the counts: exactly nothing, forward and backward
        assert torch.equal(got[-extra:], torch.zeros(extra, H)) and torch.equal(got_x[-extra:], torch.zeros(extra, H))
    for n, g in got_w.items():  # the expert without rows: a zero gradient (not garbage)
        assert torch.equal(g[1], torch.zeros_like(g[1])), n
    assert syncs.count == (1 if path == "padded" else 0), syncs.report()
    if path == "padded":  # the largest count, read once; known counts spare it
        with SyncCounter() as known:
            ex(torch.randn(sum(COUNTS), H), counts, known=COUNTS).sum().backward()
        assert known.count == 0, known.report()


def test_the_fallback_is_chosen_where_grouped_gemms_cannot_run():
    ex = _experts("swiglu", False)
    assert ex.grouped(torch.zeros(3, H)) == HAS_GROUPED_MM
    assert not ex.grouped(torch.zeros(0, H))  # no rows: the grouped GEMM's backward rejects them
    assert not ex.grouped(torch.zeros(3, H, dtype=torch.float64))  # a dtype it does not take
    odd = GroupedExperts(H, 6, "swiglu", 8, LOCAL, 0, "e", seed=3, std=0.2, out_std=0.2)  # 24-byte rows
    assert not odd.grouped(torch.zeros(3, H))
    counts = torch.tensor(COUNTS)
    x = torch.randn(sum(COUNTS), H, dtype=torch.float64)
    ex64 = ex.double()
    # float64: the grouped GEMM vs a loop over experts, another summation order (~1e-16 per op)
    torch.testing.assert_close(ex64(x, counts), _loop(ex64, x, COUNTS), rtol=0, atol=1e-12)


def test_zero_rows_give_zero_gradients():
    """An ep rank no row was sent to: (0, h) out, every expert parameter a zero gradient (not None)."""
    ex = _experts("swiglu", True)
    rows = torch.zeros(0, H, requires_grad=True)
    with SyncCounter() as syncs:
        out = ex(rows, torch.zeros(LOCAL, dtype=torch.long), known=[0] * LOCAL)
        out.sum().backward()
    assert out.shape == (0, H) and rows.grad.shape == (0, H) and syncs.count == 0
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in ex.parameters())
