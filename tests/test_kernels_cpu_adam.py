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
    # the comment above: fp32 rounds p by at most 2^-24 of its scale per step, 100 steps
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
        for a, b in zip(res, results["scalar"], strict=True):
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
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


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


# Sizes not multiples of any vector width, empty tensors, chunk-sized ones and two that together pass the
# threading threshold (2 x 2^18 elements), so chunks cross tensor boundaries.
LIST_SIZES = [0, 1, 5, 16, 17, 63, 64, 65, 1037, 65536 + 3, 300001, 0, 7, 300007]


def make_lists(sizes, seed, grad_dtype=torch.float32, copy_dtype=None):
    """Random fp32 params and states (m, v >= 0), grads in grad_dtype and, with copy_dtype, empty copies."""
    gen = torch.Generator().manual_seed(seed)
    p = [torch.randn(n, generator=gen) for n in sizes]
    g = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
    m = [0.1 * torch.randn(n, generator=gen) for n in sizes]
    v = [0.01 * torch.rand(n, generator=gen) for n in sizes]
    c = None if copy_dtype is None else [torch.empty(n, dtype=copy_dtype) for n in sizes]
    return p, g, m, v, c


def per_tensor_hyper(n, seed):
    """n learning rates and n weight decays (some 0: the no-decay run of a shard)."""
    gen = torch.Generator().manual_seed(seed)
    lrs = (1e-3 * (1 + 9 * torch.rand(n, generator=gen, dtype=torch.float64))).tolist()
    wds = [0.0 if i % 3 == 0 else 0.05 * (1 + i % 4) for i in range(n)]
    return lrs, wds


def clone_all(*lists):
    return [None if lst is None else [t.clone() for t in lst] for lst in lists]


@pytest.mark.parametrize("copy_dtype", [None, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("flags", [dict(adamw_mode=True), dict(adamw_mode=False, maximize=True),
                                   dict(adamw_mode=True, bias_correction=False, beta1=0.3)], ids=["w", "l2max", "nobc"])
def test_list_call_equals_single_calls_bit_for_bit(ops, monkeypatch, copy_dtype, grad_dtype, flags):
    lrs, wds = per_tensor_hyper(len(LIST_SIZES), seed=1)
    hyper = dict(beta1=0.9, beta2=0.999, eps=1e-8, adamw_mode=True, bias_correction=True, maximize=False) | flags
    before = torch.get_num_threads()
    for isa in supported_isas(ops):
        monkeypatch.setenv("MEGAZERO_CPU_ADAM_ISA", isa)
        p, g, m, v, c = make_lists(LIST_SIZES, seed=2, grad_dtype=grad_dtype, copy_dtype=copy_dtype)
        q, m2, v2, c2 = clone_all(p, m, v, c)
        try:
            torch.set_num_threads(max(2, before))  # the parallel region, chunks taken across tensors
            for step in (1, 2):
                used = adam_step(p, g, m, v, step=step, lr=lrs, weight_decay=wds, param_copy=c, **hyper)
                assert used == f"megazero_cpu_adam[{isa}]"
                for i in range(len(LIST_SIZES)):  # the single-tensor op, same hyper-parameters
                    ops.adam_step(q[i], g[i], m2[i], v2[i], None if c2 is None else c2[i], lrs[i], hyper["beta1"],
                                  hyper["beta2"], hyper["eps"], wds[i], step, hyper["adamw_mode"],
                                  hyper["bias_correction"], hyper["maximize"], ISAS[isa])
        finally:
            torch.set_num_threads(before)
        for name, ours, single in (("param", p, q), ("exp_avg", m, m2), ("exp_avg_sq", v, v2), ("copy", c, c2)):
            for i, (a, b) in enumerate(zip(ours or [], single or [], strict=True)):
                assert torch.equal(a, b), f"{isa}: {name}[{i}] (numel {a.numel()}) differs from the single call"


def test_list_call_on_one_thread_and_shared_values_equal_single_calls(ops):
    """The serial path (one thread) and the op's one-value-for-all form."""
    p, g, m, v, _ = make_lists(LIST_SIZES, seed=3)
    q, m2, v2 = clone_all(p, m, v)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ops.multi_tensor_adam(p, g, m, v, [], [1e-2], 0.9, 0.99, 1e-8, [0.1], 3, True, True, False, -1) \
            == ops.best_isa()
    finally:
        torch.set_num_threads(before)
    for i in range(len(LIST_SIZES)):
        ops.adam_step(q[i], g[i], m2[i], v2[i], None, 1e-2, 0.9, 0.99, 1e-8, 0.1, 3, True, True, False, -1)
    assert all(torch.equal(a, b) for a, b in zip(p + m + v, q + m2 + v2, strict=True))


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_list_call_with_per_tensor_hyper_matches_the_twin(ops, adamw):
    sizes = [1, 17, 1037, 4099]
    lrs, wds = per_tensor_hyper(len(sizes), seed=4)
    p, _, m, v, _ = make_lists(sizes, seed=5)
    twin = clone_all(p, m, v)
    gen = torch.Generator().manual_seed(6)
    for step in range(1, 31):
        g = [torch.randn(n, generator=gen) for n in sizes]
        adam_step(p, g, m, v, step=step, lr=lrs, weight_decay=wds, adamw_mode=adamw)
        for i in range(len(sizes)):
            reference.adam_step(twin[0][i], g[i], twin[1][i], twin[2][i], step=step, lr=lrs[i], beta1=0.9,
                                beta2=0.999, eps=1e-8, weight_decay=wds[i], adamw_mode=adamw, bias_correction=True)
    rtol, atol = reference.TOLERANCES["adam"][torch.float32]
    for ours, ref in zip(p + m + v, twin[0] + twin[1] + twin[2], strict=True):
        torch.testing.assert_close(ours, ref, rtol=rtol, atol=atol * float(ref.abs().max()))


def test_per_tensor_hyper_reaches_the_reference_path_too():
    p = [torch.randn(n, dtype=torch.float64) for n in (3, 9)]
    states = [[torch.zeros_like(t) for t in p] for _ in range(2)]
    g = [torch.randn_like(t) for t in p]
    q = [t.clone() for t in p]
    assert adam_step(p, g, *states, step=1, lr=[1e-2, 1e-3], weight_decay=(0.0, 0.5)) == "reference"
    for i, (lr, wd) in enumerate([(1e-2, 0.0), (1e-3, 0.5)]):
        reference.adam_step(q[i], g[i], torch.zeros_like(q[i]), torch.zeros_like(q[i]), step=1, lr=lr, beta1=0.9,
                            beta2=0.999, eps=1e-8, weight_decay=wd, adamw_mode=True, bias_correction=True)
        assert torch.equal(p[i], q[i])


def test_per_tensor_hyper_errors(ops):
    p, g, m, v, _ = make_lists([5, 6, 7], seed=7)
    with pytest.raises(ValueError, match="adam_step: lr has 2 values, param has 3 tensors"):
        adam_step(p, g, m, v, step=1, lr=[1e-3, 1e-3])
    with pytest.raises(ValueError, match="adam_step: weight_decay has 4 values, param has 3 tensors"):
        adam_step(p, g, m, v, step=1, lr=1e-3, weight_decay=[0.0] * 4)
    with pytest.raises(ValueError, match="lr has 3 values, param has 1 tensors"):
        adam_step(p[0], g[0], m[0], v[0], step=1, lr=[1e-3] * 3)
    with pytest.raises(TypeError, match="lr='fast'; expected a float or a sequence of floats"):
        adam_step(p, g, m, v, step=1, lr="fast")
    args = (0.9, 0.999, 1e-8)
    with pytest.raises(RuntimeError, match=r"lr has 2 values; expected 3 \(one per tensor\) or 1"):
        ops.multi_tensor_adam(p, g, m, v, [], [1e-3, 1e-3], *args, [0.0], 1, True, True, False, -1)
    with pytest.raises(RuntimeError, match="weight_decay has 0 values; expected 3"):
        ops.multi_tensor_adam(p, g, m, v, [], [1e-3], *args, [], 1, True, True, False, -1)
    with pytest.raises(RuntimeError, match="grads has 2 tensors, params has 3"):
        ops.multi_tensor_adam(p, g[:2], m, v, [], [1e-3], *args, [0.0], 1, True, True, False, -1)
    with pytest.raises(RuntimeError, match=r"exp_avgs\[1\] has 5 elements but params\[1\] has 6"):
        ops.multi_tensor_adam(p, g, [m[0], m[0], m[2]], v, [], [1e-3], *args, [0.0], 1, True, True, False, -1)
    with pytest.raises(RuntimeError, match=r"param_copies\[0\] must be bfloat16 or float16"):
        ops.multi_tensor_adam(p, g, m, v, [t.clone() for t in p], [1e-3], *args, [0.0], 1, True, True, False, -1)
    with pytest.raises(RuntimeError, match="step=0; expected >= 1"):
        ops.multi_tensor_adam(p, g, m, v, [], [1e-3], *args, [0.0], 0, True, True, False, -1)


def test_cpu_adam_steps_mixed_groups_like_adamw(ops):
    """A group mixing fp32 and fp64 parameters (and one without a grad): one kernel call for the fp32 ones."""
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(n, dtype=dt)) for n, dt in [(40, torch.float32), (7, torch.float64),
                                                                     (9, torch.float32), (3, torch.float32)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ours = CPUAdam([{"params": ps[:3], "weight_decay": 0.1}, {"params": ps[3:], "weight_decay": 0.0}], lr=1e-2)
    ref = torch.optim.AdamW([{"params": twins[:3], "weight_decay": 0.1}, {"params": twins[3:], "weight_decay": 0.0}],
                            lr=1e-2, foreach=False)
    for step in range(5):
        for a, b in zip(ps, twins, strict=True):
            a.grad = torch.randn_like(a) if step % 2 or a.numel() != 3 else None
            b.grad = None if a.grad is None else a.grad.clone()
        ours.step()
        ref.step()
    for a, b in zip(ps, twins, strict=True):
        assert_rel(a.detach(), b.detach(), 1e-6)


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
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert_rel(a.detach(), b.detach(), 1e-5)  # 30 steps through a network: differences feed back into grads
    fresh = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.05, adamw_mode=False)
    fresh.load_state_dict(copy.deepcopy(ref.state_dict()))  # AdamW's groups: adamw_mode comes back True
    assert fresh.param_groups[0]["adamw_mode"] and float(fresh.state[next(model.parameters())]["step"]) == 30.0
    model.load_state_dict(twin.state_dict())
    for net, opt in ((model, fresh), (twin, ref)):  # both continue from the same point
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert_rel(a.detach(), b.detach(), 1e-6)


def test_cpu_adam_rejects_what_it_cannot_do():
    w = [torch.nn.Parameter(torch.randn(3))]
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        CPUAdam(w, amsgrad=True)
    with pytest.raises(ValueError, match=r"betas\[1\]=1.0"):
        CPUAdam(w, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr=-1"):
        CPUAdam(w, lr=-1)
