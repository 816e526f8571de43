"""megazero's CUDA kernels (megazero_cuda) against their reference twins, on a GPU.

Tolerances: reference.TOLERANCES per op and dtype, with atol taken relative to the tensor's scale
(max(1, max|twin|)). The multi-tensor Adam must equal the CPU kernel bit for bit (same IEEE operations).
Run by tools/gpu_check.sh; skipped without a CUDA device.
"""
import pytest
import torch

from megazero.runtime import kernels as K
from megazero.runtime.kernels import build, loader, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (megazero_cuda runs on GPUs)"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module", autouse=True)
def cuda_ops():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGAZERO_KERNELS", "strict")  # a failed build is an error here, not a fallback
        ops = loader.extension(build.CUDA_OPS)
    assert ops is not None
    return ops


def close(ours: torch.Tensor, twin: torch.Tensor, op: str, dtype: torch.dtype, what: str):
    assert ours.dtype == twin.dtype and ours.shape == twin.shape, what
    rtol, atol = reference.TOLERANCES[op][dtype]
    scale = max(1.0, float(twin.float().abs().max())) if twin.numel() else 1.0
    torch.testing.assert_close(ours.float(), twin.float(), rtol=rtol, atol=atol * scale, msg=lambda m: f"{what}: {m}")


def probe_like(out: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The fixed upstream gradient fwd_bwd uses for an output like `out`."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)


def fwd_bwd(fn, inputs, seed=0):
    """Output and input gradients of sum(fn(*inputs) * probe) for a fixed random probe."""
    leaves = [None if t is None else t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    out.backward(probe_like(out, seed))
    return out.detach(), [None if t is None or not t.requires_grad else t.grad for t in leaves]


# cols covers every row plan: registers with 1, 4 and 16 elements per thread, and the re-reading kernel.
NORM_COLS = [1, 7, 64, 1000, 1024, 1025, 4096, 5000, 16384, 20000]


# (x dtype, weight dtype): weights in x's dtype, or fp32 weights with 16-bit activations (mixed precision)
NORM_DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
               (torch.bfloat16, torch.float32), (torch.float16, torch.float32)]


@pytest.mark.parametrize("cols", NORM_COLS)
@pytest.mark.parametrize("dtype,wdt", NORM_DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
def test_norms_match_twin(cols, dtype, wdt, rms):
    gen = torch.Generator(device="cuda").manual_seed(cols)
    x = (torch.randn(37, cols, device="cuda", generator=gen) * 2 + 0.5).to(dtype)
    w = (1 + 0.1 * torch.randn(cols, device="cuda", generator=gen)).to(wdt)
    b = (0.1 * torch.randn(cols, device="cuda", generator=gen)).to(wdt)
    op = "rms_norm" if rms else "layer_norm"
    if rms:
        assert K.norm.backend(x, w, None, rms=True) == "megazero_cuda"
        ours, ours_g = fwd_bwd(lambda a, c: K.rms_norm(a, c, 1e-5), [x, w])
        twin, twin_g = fwd_bwd(lambda a, c: reference.rms_norm(a, c, 1e-5), [x, w])
    else:
        assert K.norm.backend(x, w, b) == "megazero_cuda"
        ours, ours_g = fwd_bwd(lambda a, c, d: K.layer_norm(a, c, d, 1e-5), [x, w, b])
        twin, twin_g = fwd_bwd(lambda a, c, d: reference.layer_norm(a, c, d, 1e-5), [x, w, b])
    close(ours, twin, op, dtype, "y")
    for name, g, t in zip(["dx", "dw", "db"], ours_g, twin_g, strict=True):
        close(g, t, op, dtype, name)


def test_norm_edge_cases():
    x = torch.randn(4, 6, 8, device="cuda")
    w, b = torch.randn(6, 8, device="cuda"), torch.randn(6, 8, device="cuda")
    close(K.layer_norm(x, w, b), reference.layer_norm(x, w, b), "layer_norm", torch.float32, "2 trailing dims")
    xt = torch.randn(8, 5, device="cuda").t()  # non-contiguous
    close(K.layer_norm(xt, w[0], b[0]), reference.layer_norm(xt, w[0], b[0]), "layer_norm", torch.float32, "t()")
    empty = torch.randn(0, 8, device="cuda", requires_grad=True)
    wl = w[0].clone().requires_grad_()
    K.layer_norm(empty, wl, None).sum().backward()
    assert empty.grad.shape == (0, 8) and torch.equal(wl.grad, torch.zeros_like(wl))


SOFTMAX_SHAPES = [(2, 3, 5, 37), (1, 2, 4, 1024), (1, 1, 3, 1025), (2, 2, 16, 4096), (1, 1, 1, 1), (3, 1, 2, 31)]


@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mask_kind", ["none", "shared", "per_batch"])
def test_scaled_masked_softmax_matches_twin(shape, dtype, mask_kind):
    b, _, sq, sk = shape
    gen = torch.Generator(device="cuda").manual_seed(sk)
    x = (3 * torch.randn(shape, device="cuda", generator=gen)).to(dtype)
    mask = None
    if mask_kind != "none":
        mask = torch.rand((b if mask_kind == "per_batch" else 1, 1, sq, sk), device="cuda", generator=gen) < 0.3
        mask[..., 0, :] = True  # a fully masked row: uniform output, zero gradient
    assert K.softmax.backend(x, mask) == "megazero_cuda"
    ours, (g,) = fwd_bwd(lambda s: K.scaled_masked_softmax(s, mask, 0.37), [x])
    twin, _ = fwd_bwd(lambda s: reference.scaled_masked_softmax(s, mask, 0.37), [x])
    close(ours, twin, "softmax", dtype, "y")
    close(g, reference.softmax_backward(ours, probe_like(ours), mask, 0.37), "softmax_backward", dtype, "dx")
    if mask is not None:
        assert (g.masked_select(mask.expand_as(g)) == 0).all()


@pytest.mark.parametrize("seq", [1, 17, 128, 1024, 1100])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_softmax_matches_twin(seq, dtype):
    gen = torch.Generator(device="cuda").manual_seed(seq)
    x = (3 * torch.randn(2, 3, seq, seq, device="cuda", generator=gen)).to(dtype)
    ours, (g,) = fwd_bwd(lambda s: K.scaled_upper_triang_masked_softmax(s, 0.5), [x])
    twin, _ = fwd_bwd(lambda s: reference.scaled_upper_triang_masked_softmax(s, 0.5), [x])
    close(ours, twin, "softmax", dtype, "y")
    above = reference.causal_mask(seq, seq, "cuda")
    close(g, reference.softmax_backward(ours, probe_like(ours), above, 0.5), "softmax_backward", dtype, "dx")
    assert (ours[..., above] == 0).all() and (g[..., above] == 0).all()
    x3 = x[0]  # (heads, sq, sk): any leading dims
    close(K.scaled_upper_triang_masked_softmax(x3, 0.5), reference.scaled_upper_triang_masked_softmax(x3, 0.5),
          "softmax", dtype, "3-d")


@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("flags", [dict(adamw_mode=True), dict(adamw_mode=False, maximize=True),
                                   dict(bias_correction=False, beta1=0.3)], ids=["w", "l2max", "nobc"])
def test_multi_tensor_adam_equals_the_cpu_kernel_bit_for_bit(grad_dtype, copy_dtype, flags):
    """One launch over tensors with their own lr and weight decay equals the CPU list kernel bit for bit."""
    sizes = [1, 100, 65536, 65537, 300001]
    gen = torch.Generator().manual_seed(0)
    cpu = [[torch.randn(n, generator=gen) for n in sizes]]
    cpu += [[torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]]
    gpu = [[t.cuda() for t in lst] for lst in cpu]
    copies = {dev: None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype, device=dev) for n in sizes]
              for dev in ("cpu", "cuda")}
    for step in range(1, 4):
        grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
        # per-tensor lr and weight decay (some tensors without decay), as the ZeRO optimizer passes them
        hyper = dict(step=step, lr=[1e-2, 3e-3, 1e-2, 5e-3, 2e-2], weight_decay=[0.1, 0.0, 0.05, 0.1, 0.0], **flags)
        used_gpu = K.adam_step(gpu[0], [g.cuda() for g in grads], gpu[1], gpu[2], param_copy=copies["cuda"], **hyper)
        used_cpu = K.adam_step(cpu[0], grads, cpu[1], cpu[2], param_copy=copies["cpu"], **hyper)
    assert used_gpu == "megazero_cuda"
    assert used_cpu.startswith("megazero_cpu_adam"), "the CPU kernel is the bit-exact yardstick here"
    for lst_c, lst_g in zip(cpu, gpu, strict=True):
        for c, g in zip(lst_c, lst_g, strict=True):
            assert torch.equal(c, g.cpu())
    if copy_dtype is not None:
        for c, cc, p in zip(copies["cuda"], copies["cpu"], gpu[0], strict=True):
            assert torch.equal(c, p.to(copy_dtype)) and torch.equal(c.cpu(), cc)


def test_kernel_info_reports_the_cuda_extension():
    info = K.kernel_info()
    assert all(v == "megazero_cuda" for v in info["cuda"].values()), info


def test_fp64_accumulated_grad_norm_on_cuda():
    """The optimizer's gradient norm (`ZeroOptimizer._squared_norm`) asks torch's multi-tensor norm for fp64
    accumulation of fp32 ranges: on CUDA too it must be exact to fp64 rounding, whatever the range lengths."""
    torch.manual_seed(0)
    ranges = [torch.randn(n, device="cuda") * 1e-3 + 2e-3 for n in (4_000_000, 1_000_000, 3)]
    norms = torch._foreach_norm(ranges, 2, dtype=torch.float64)
    assert all(n.dtype == torch.float64 for n in norms)
    got = torch.stack(norms).square().sum().item()
    exact = sum(r.double().square().sum().item() for r in ranges)
    # fp64 accumulation against an fp64 reference: the ranges add in another order, ~1e-16 each
    assert abs(got - exact) / exact < 1e-12
