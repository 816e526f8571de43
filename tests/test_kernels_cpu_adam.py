"""The SIMD CPU Adam kernel (megazero_cpu_adam) against torch.optim.AdamW/Adam, float64 and itself across ISAs.

Tolerance vs torch (fp32, 100 steps): |ours - torch| <= 1e-6 * (|torch| + max|torch|), i.e. 1e-6 relative
elementwise with the tensor's scale as the floor for entries near zero (an entry crossing zero has no useful
relative error). The residue: torch's own sqrt is 1 ulp off on vectorised CPU builds, and the kernel fuses
denom = sqrt(v) * (1/sqrt(bc2)) + eps into one fma; every other operation follows torch's order.
"""
import copy

import pytest
import torch

from megazero.runtime.kernels import CPUAdam, adam_step, loader, reference

# 70001: two 64K-element chunks on one thread; 600001: chunks shared by OpenMP threads
SIZES = [(1,), (7,), (15,), (16,), (17,), (33,), (3, 5, 7), (4099,), (70001,), (600001,)]
ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}


@pytest.fixture(scope="module")
def ops():
    ops = loader.cpu_adam()
    if ops is None:
        pytest.skip("the CPU Adam extension could not be built here (see the one-line message above)")
    return ops


def supported_isas(ops):
    out = []
    for name, code in ISAS.items():
        p, g, m, v = torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1)
        try:
            ops.adam_step(p, g, m, v, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, True, False, code)
            out.append(name)
        except RuntimeError:
            pass
    return out


def assert_rel(ours: torch.Tensor, ref: torch.Tensor, rel: float):
    scale = float(ref.abs().max())
    torch.testing.assert_close(ours, ref, rtol=rel, atol=rel * scale)


def run_ours(shape, steps, *, grad_dtype=torch.float32, copy_dtype=None, seed=0, **hyper):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=gen)
    m, v = torch.zeros(shape), torch.zeros(shape)
    copy = None if copy_dtype is None else torch.empty(shape, dtype=copy_dtype)
    for step in range(1, steps + 1):
        g = torch.randn(shape, generator=gen).to(grad_dtype)
        used = adam_step(p, g, m, v, step=step, param_copy=copy, **hyper)
    return p, m, v, copy, used


def run_torch(shape, steps, cls, *, grad_dtype=torch.float32, seed=0, **kw):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(shape, generator=gen).requires_grad_()
    opt = cls([p], foreach=False, **kw)
    for _ in range(steps):
        p.grad = torch.randn(shape, generator=gen).to(grad_dtype).float()
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"]


@pytest.mark.parametrize("shape", SIZES, ids=str)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_matches_torch_after_100_steps(ops, shape, adamw, wd):
    lr, betas, eps = 1e-3, (0.9, 0.999), 1e-8
    p, m, v, _, used = run_ours(shape, 100, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd,
                                adamw_mode=adamw)
    assert used.startswith("megazero_cpu_adam")
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    tp, tm, tv = run_torch(shape, 100, cls, lr=lr, betas=betas, eps=eps, weight_decay=wd)
    assert_rel(p, tp, 1e-6)
    assert_rel(m, tm, 1e-6)
    assert_rel(v, tv, 1e-6)


@pytest.mark.parametrize("beta1", [0.3, 0.5])  # 1 - beta1 >= 0.5: torch.lerp's other branch
def test_matches_torch_large_lerp_weight(ops, beta1):
    p, m, v, _, _ = run_ours((1001,), 100, lr=1e-2, beta1=beta1, beta2=0.99, weight_decay=0.01)
    tp, tm, _ = run_torch((1001,), 100, torch.optim.AdamW, lr=1e-2, betas=(beta1, 0.99), weight_decay=0.01)
    assert_rel(p, tp, 1e-6)
    assert_rel(m, tm, 1e-6)


def test_maximize_matches_torch(ops):
    p, _, _, _, _ = run_ours((333,), 100, lr=1e-3, weight_decay=0.01, maximize=True)
    tp, _, _ = run_torch((333,), 100, torch.optim.AdamW, lr=1e-3, weight_decay=0.01, maximize=True)
    assert_rel(p, tp, 1e-6)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_16bit_grads_match_torch_on_the_same_values(ops, grad_dtype):
    p, m, v, _, _ = run_ours((4099,), 100, grad_dtype=grad_dtype, lr=1e-3, weight_decay=0.01)
    tp, tm, tv = run_torch((4099,), 100, torch.optim.AdamW, grad_dtype=grad_dtype, lr=1e-3, weight_decay=0.01)
    assert_rel(p, tp, 1e-6)
    assert_rel(v, tv, 1e-6)


# the last shape is large enough for the copy's non-temporal stores
@pytest.mark.parametrize("shape", [(1,), (17,), (4099,), (70001,), ((1 << 21) + 37,)], ids=str)
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_param_copy_is_the_fp32_result_rounded(ops, shape, copy_dtype):
    p, _, _, copy, _ = run_ours(shape, 20, copy_dtype=copy_dtype, lr=1e-2, weight_decay=0.01)
    assert torch.equal(copy, p.to(copy_dtype))  # torch rounds to nearest even
    q, _, _, _, _ = run_ours(shape, 20, lr=1e-2, weight_decay=0.01)
    assert torch.equal(p, q)  # writing the copy does not change the fp32 result


def test_bf16_copy_rounds_ties_to_even_and_keeps_nan(ops):
    # p = 0 after the step (lr=0), so the copy is exactly the bf16 rounding of these fp32 bit patterns.
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0x00000001, 0x80008000, 0x7FC00001],
                        dtype=torch.int64).to(torch.int32)
    p = bits.view(torch.float32).clone()
    copy = torch.empty(p.shape, dtype=torch.bfloat16)
    adam_step(p, torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p), step=1, lr=0.0, param_copy=copy)
    ref = p.to(torch.bfloat16)
    finite = ~p.isnan()
    assert torch.equal(copy[finite].view(torch.int16), ref[finite].view(torch.int16))
    # NaN becomes the quiet NaN 0x7FC0 (c10::BFloat16's scalar rule; torch's vector path writes 0xFFFF)
    assert copy[~finite].view(torch.int16).tolist() == [0x7FC0]


def test_bias_correction_off_matches_the_twin_and_float64(ops):
    shape, hyper = (2053,), dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw_mode=True)
    p, _, _, _, _ = run_ours(shape, 100, bias_correction=False, **hyper)
    runs = {}
    for dtype in (torch.float32, torch.float64):
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(shape, generator=gen).to(dtype)
        m, v = torch.zeros_like(q), torch.zeros_like(q)
        for step in range(1, 101):
            g = torch.randn(shape, generator=gen).to(dtype)
            reference.adam_step(q, g, m, v, step=step, bias_correction=False, **hyper)
        runs[dtype] = q
    assert_rel(p, runs[torch.float32], 1e-6)  # torch.optim has no bias_correction=False: the fp32 twin is the spec
    # Against exact arithmetic the bound is fp32's own: each step rounds p by at most 2^-24 of its scale.
    torch.testing.assert_close(p, runs[torch.float64].float(), rtol=0,
                               atol=100 * 2.0**-24 * float(runs[torch.float64].abs().max()))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flags", [dict(adamw_mode=True), dict(adamw_mode=False, maximize=True),
                                   dict(adamw_mode=True, bias_correction=False, beta1=0.3)], ids=["w", "l2max", "nobc"])
def test_every_isa_gives_the_same_bits(ops, monkeypatch, grad_dtype, copy_dtype, flags):
    isas = supported_isas(ops)
    assert "scalar" in isas
    results = {}
    for isa in isas:
        monkeypatch.setenv("MEGAZERO_CPU_ADAM_ISA", isa)
        p, m, v, copy, used = run_ours((1000 + 37,), 3, grad_dtype=grad_dtype, copy_dtype=copy_dtype, lr=1e-2,
                                       weight_decay=0.1, **flags)
        assert used == f"megazero_cpu_adam[{isa}]"
        results[isa] = (p, m, v) + ((copy,) if copy is not None else ())
    for isa, res in results.items():
        for a, b in zip(res, results["scalar"]):
            assert torch.equal(a, b), f"{isa} differs from scalar"


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_streaming_copy_gives_the_same_bits_on_every_isa(ops, monkeypatch, copy_dtype):
    n = (1 << 21) + 37  # at least 2^21 elements: the copy goes out with non-temporal stores
    copies = {}
    for isa in supported_isas(ops):
        monkeypatch.setenv("MEGAZERO_CPU_ADAM_ISA", isa)
        p, _, _, copies[isa], _ = run_ours((n,), 1, copy_dtype=copy_dtype, lr=1e-2)
        assert torch.equal(copies[isa], p.to(copy_dtype)), isa


def test_threads_do_not_change_the_bits(ops):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run_ours((600001,), 3, lr=1e-2, weight_decay=0.1)[:3]
        torch.set_num_threads(max(2, before))
        many = run_ours((600001,), 3, lr=1e-2, weight_decay=0.1)[:3]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, many))


def test_lists_and_kernel_errors(ops):
    ps = [torch.randn(n) for n in (5, 100)]
    used = adam_step(ps, [torch.randn_like(p) for p in ps], [torch.zeros_like(p) for p in ps],
                     [torch.zeros_like(p) for p in ps], step=1, lr=1e-3)
    assert used.startswith("megazero_cpu_adam")
    with pytest.raises(ValueError, match="grad has 1 tensors, param has 2"):
        adam_step(ps, [torch.randn(5)], ps, ps, step=1, lr=1e-3)
    with pytest.raises(ValueError, match="step=0"):
        adam_step(ps[0], ps[0], ps[0], ps[0], step=0, lr=1e-3)
    with pytest.raises(RuntimeError, match="grad has 4 elements but param has 5"):
        ops.adam_step(ps[0], torch.randn(4), torch.zeros(5), torch.zeros(5), None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1,
                      True, True, False, -1)


def test_non_fp32_params_use_the_reference():
    p = torch.randn(10, dtype=torch.float64)
    used = adam_step(p, torch.randn_like(p), torch.zeros_like(p), torch.zeros_like(p), step=1, lr=1e-3)
    assert used == "reference"


def test_cpu_adam_optimizer_matches_adamw_and_loads_its_state(ops):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 3))
    twin = torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 3))
    twin.load_state_dict(model.state_dict())
    ours = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.05, foreach=False)
    x = torch.randn(64, 13)
    for _ in range(30):
        for net, opt in ((model, ours), (twin, ref)):
            opt.zero_grad()
            net(x).square().mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert_rel(a.detach(), b.detach(), 1e-5)  # 30 steps through a network: differences feed back into grads
    fresh = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=False)
    fresh.load_state_dict(copy.deepcopy(ref.state_dict()))  # AdamW's groups: adamw_mode comes back True
    assert fresh.param_groups[0]["adamw_mode"] and float(fresh.state[next(model.parameters())]["step"]) == 30.0
    model.load_state_dict(twin.state_dict())
    for net, opt in ((model, fresh), (twin, ref)):  # both continue from the same point
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert_rel(a.detach(), b.detach(), 1e-6)


def test_cpu_adam_rejects_what_it_cannot_do():
    w = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        CPUAdam(w, amsgrad=True)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0"):
        CPUAdam(w, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr=-1"):
        CPUAdam(w, lr=-1)
