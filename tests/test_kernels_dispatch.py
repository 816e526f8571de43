"""The dispatch point megazero.runtime.kernels: lazy, cheap import; the fallback chain; one-line build failures;
MEGAZERO_KERNELS; the public ops on CPU (reference twins, autograd-correct)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import megazero.runtime.kernels as K
from megazero.runtime.kernels import build, loader, reference

ROOT = Path(__file__).resolve().parents[1]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300,
                          cwd=ROOT)


def test_import_compiles_nothing(tmp_path):
    code = ("import sys, megazero.runtime.kernels, megazero.runtime.kernels.reference\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch.utils.cpp_extension')))")
    out = run_python(code, MEGAZERO_CACHE_DIR=str(tmp_path / "cache"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
    assert not (tmp_path / "cache").exists()


def test_missing_compiler_prints_one_line_and_falls_back(tmp_path):
    code = """
import json, torch, megazero.runtime.kernels as K
from megazero.runtime.kernels import reference
gen = torch.Generator().manual_seed(0)
p, g = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
state = [t.clone() for t in (p, g, torch.zeros(1000), torch.zeros(1000))]
twin = [t.clone() for t in state]
used = [K.adam_step(*state, step=s, lr=1e-3) for s in (1, 2)]
for s in (1, 2):
    reference.adam_step(*twin, step=s, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                        adamw_mode=True, bias_correction=True)
print(json.dumps({"used": used, "same": torch.equal(state[0], twin[0]), "info": K.kernel_info()["cpu"]}))
"""
    out = run_python(code, CXX=str(tmp_path / "no-such-compiler"), MEGAZERO_CACHE_DIR=str(tmp_path / "cache"),
                     MEGAZERO_KERNELS="auto")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {"used": ["reference", "reference"], "same": True, "info": result["info"]}
    assert result["info"]["adam_step"] == "reference"
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("megazero.runtime.kernels: could not build the CPU Adam kernel")
    assert "no-such-compiler" in lines[0] and "Fix:" in lines[0]


def test_compile_error_is_one_line_or_raises_in_strict_mode(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.cpp"
    bad.write_text("int f() { return not_declared_anywhere; }\n")
    monkeypatch.setenv("MEGAZERO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_CACHE", {})
    monkeypatch.setenv("MEGAZERO_KERNELS", "strict")
    with pytest.raises(loader.KernelBuildError, match="not_declared_anywhere"):
        loader.extension(build.ExtSpec("megazero_test_broken_strict", (str(bad),), cuda=False))
    spec = build.ExtSpec("megazero_test_broken_ext", (str(bad),), cuda=False)
    monkeypatch.setenv("MEGAZERO_KERNELS", "auto")
    assert loader.extension(spec) is None
    assert loader.extension(spec) is None  # cached: no second attempt, no second line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not_declared_anywhere" in err[0]
    assert (tmp_path / "cache" / "megazero_test_broken_ext-build-failure.log").exists()


def test_reference_mode_and_bad_mode(monkeypatch):
    monkeypatch.setenv("MEGAZERO_KERNELS", "reference")
    p = torch.randn(10)
    assert K.adam_step(p, torch.randn(10), torch.zeros(10), torch.zeros(10), step=1, lr=1e-3) == "reference"
    assert K.kernel_info()["cpu"]["adam_step"] == "reference"
    assert loader.apex("amp_C") is None
    monkeypatch.setenv("MEGAZERO_KERNELS", "fast")
    with pytest.raises(ValueError, match="MEGAZERO_KERNELS='fast'; valid: 'auto'"):
        loader.mode()


def test_kernel_info_names_every_op():
    info = K.kernel_info()
    assert info["mode"] in loader.MODES
    for side in ("cpu", "cuda"):
        assert set(info[side]) == set(K.OPS)
    assert info["cpu"]["layer_norm"] == "reference"
    if not torch.cuda.is_available():
        assert all(v.startswith("unavailable") for v in info["cuda"].values())


def test_public_ops_on_cpu_are_the_twins():
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 16, generator=gen), torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    assert torch.equal(K.layer_norm(x, w, b, 1e-5), reference.layer_norm(x, w, b, 1e-5))
    assert torch.equal(K.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    s = torch.randn(2, 3, 8, 8, generator=gen)
    mask = torch.rand(2, 1, 8, 8, generator=gen) < 0.3
    assert torch.equal(K.scaled_masked_softmax(s, mask, 0.5), reference.scaled_masked_softmax(s, mask, 0.5))
    assert torch.equal(K.scaled_upper_triang_masked_softmax(s, 0.5),
                       reference.scaled_upper_triang_masked_softmax(s, 0.5))


def test_public_ops_pass_gradcheck_in_float64():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: K.layer_norm(*t, 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(lambda *t: K.rms_norm(*t, 1e-5), (x, w))
    s = torch.randn(1, 2, 4, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[[[0, 1, 0, 0]] * 4]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda t: K.scaled_masked_softmax(t, mask, 0.7), (s,))
    assert torch.autograd.gradcheck(lambda t: K.scaled_upper_triang_masked_softmax(t, 0.7), (s,))


def test_argument_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"weight shape \(7,\) must equal the trailing dims of x"):
        K.layer_norm(torch.randn(2, 6), torch.randn(7))
    with pytest.raises(ValueError, match=r"bias shape \(5,\) must equal weight shape \(6,\)"):
        K.layer_norm(torch.randn(2, 6), torch.randn(6), torch.randn(5))
    with pytest.raises(ValueError, match="sq == sk"):
        K.scaled_upper_triang_masked_softmax(torch.randn(1, 1, 3, 4), 1.0)
    with pytest.raises(ValueError, match="mask has dtype torch.float32"):
        K.scaled_masked_softmax(torch.randn(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), 1.0)
    with pytest.raises(ValueError, match="all tensors must be on one device"):
        K.adam_step(torch.randn(2), torch.randn(2), torch.zeros(2), torch.zeros(2, device="meta"), step=1, lr=1.0)


class FakeAmpC:
    """amp_C.multi_tensor_adam's signature (one lr and weight decay per call), stepping with the reference twin."""

    def __init__(self):
        self.calls = []

    def multi_tensor_adam(self, chunk, noop, lists, lr, beta1, beta2, eps, step, mode, bias_correction, wd):
        grads, params, exp_avgs, exp_avg_sqs = lists
        self.calls.append((lr, wd, [p.numel() for p in params]))
        for g, p, m, v in zip(grads, params, exp_avgs, exp_avg_sqs, strict=True):
            reference.adam_step(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                                adamw_mode=bool(mode), bias_correction=bool(bias_correction))


def test_cuda_dispatch_passes_per_tensor_hyper(monkeypatch):
    """megazero_cuda gets one launch with per-tensor lr/wd; apex one call per distinct (lr, wd), in order."""
    from megazero.runtime.kernels import adam

    sizes, lrs, wds = [3, 4, 5, 6, 7], [1e-2, 1e-3, 1e-2, 1e-3, 1e-2], [0.1, 0.0, 0.1, 0.0, 0.0]
    gen = torch.Generator().manual_seed(0)
    lists = [[torch.randn(n, generator=gen) for n in sizes] for _ in range(2)]
    lists += [[torch.zeros(n) for n in sizes] for _ in range(2)]
    shared = dict(beta1=0.9, beta2=0.999, eps=1e-8, adamw_mode=True, bias_correction=True, maximize=False)
    launches = []

    class FakeCudaOps:
        def multi_tensor_adam(self, *args):
            launches.append(args)

    monkeypatch.setattr(loader, "cuda_ops", lambda: FakeCudaOps())
    assert adam._cuda_adam(*lists, [], 1, lrs, wds, shared) == "megazero_cuda"
    (args,) = launches
    assert args[5] == lrs and args[9] == wds and args[10] == 1
    fake = FakeAmpC()
    monkeypatch.setattr(loader, "cuda_ops", lambda: None)
    monkeypatch.setattr(loader, "apex", lambda name: fake if name == "amp_C" else None)
    twin = [[t.clone() for t in lst] for lst in lists]
    params, grads, exp_avgs, exp_avg_sqs = lists
    assert adam._cuda_adam(params, grads, exp_avgs, exp_avg_sqs, [], 1, lrs, wds, shared) == "apex"
    assert fake.calls == [(1e-2, 0.1, [3, 5]), (1e-3, 0.0, [4, 6]), (1e-2, 0.0, [7])]
    for i in range(len(sizes)):
        reference.adam_step(twin[0][i], twin[1][i], twin[2][i], twin[3][i], step=1, lr=lrs[i], weight_decay=wds[i],
                            **shared)
        assert torch.equal(params[i], twin[0][i])
    # apex has no maximize: torch's fused Adam takes the step (tests/test_kernels_build.py checks its numbers)
    assert adam._cuda_adam(*lists, [], 1, lrs, wds, shared | {"maximize": True}) == "torch"


def test_aot_extension_list_for_setup_py():
    exts, cmdclass = build.aot_extensions()
    names = [e.name for e in exts]
    assert names[0] == "megazero.runtime.kernels._megazero_cpu_adam"
    assert ("megazero.runtime.kernels._megazero_cuda" in names) == (torch.version.cuda is not None
                                                            and build.missing_tools(build.CUDA_OPS) is None)
    assert all(not Path(s).is_absolute() and (ROOT / s).exists() for e in exts for s in e.sources)
    assert "build_ext" in cmdclass
