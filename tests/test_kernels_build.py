"""Kernels built before the first collective (issue 30): the build cache key names the GPU architecture, nvcc
and torch; the JIT and ahead-of-time builds get -gencode for those architectures; ranks sharing a cache take
turns on a file lock; on CUDA a failed build falls back to torch's fused ops, not the fp32 twins; initialize
loads the run's kernels before init_distributed and any collective. CPU only: nothing here runs CUDA."""
import os

import pytest
import torch

from megazero.runtime.kernels import adam, build, loader, norm, prepare, reference

SM90 = "-gencode=arch=compute_90,code=sm_90"
SM80 = "-gencode=arch=compute_80,code=sm_80"


@pytest.fixture
def fixed_tools(monkeypatch):
    """A fixed compiler id and nvcc release, no TORCH_CUDA_ARCH_LIST: each test varies one thing."""
    monkeypatch.setattr(build, "compiler_id", lambda: "c++-0000")
    monkeypatch.setattr(build, "nvcc_version", lambda: "12.4.131")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)


def test_cache_key_changes_with_arch_nvcc_and_torch(fixed_tools, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    key = build.build_key(build.CUDA_OPS, device=0)
    assert "sm90" in key and "nvcc12.4.131" in key and torch.__version__.replace("+", "_") in key
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert build.build_key(build.CUDA_OPS, device=0) != key  # an A100 node does not load an H200 build
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert build.build_key(build.CUDA_OPS, device=0) == key
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0")  # the user's list wins over the device
    assert build.build_key(build.CUDA_OPS, device=0) not in (key,) and "sm80_90" in build.build_key(build.CUDA_OPS, 0)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(build, "nvcc_version", lambda: "12.6.20")
    assert build.build_key(build.CUDA_OPS, device=0) != key
    monkeypatch.setattr(build, "nvcc_version", lambda: "12.4.131")
    monkeypatch.setattr(torch, "__version__", "9.9.0+cu999")
    assert build.build_key(build.CUDA_OPS, device=0) != key
    assert build.build_dir(build.CUDA_OPS, device=0).parent.name == build.build_key(build.CUDA_OPS, device=0)


def test_key_changes_with_the_sources(fixed_tools, tmp_path):
    src = tmp_path / "ext"
    src.mkdir()
    (src / "a.cpp").write_text("int a() { return 1; }\n")
    (src / "a.h").write_text("int a();\n")
    spec = build.ExtSpec("megazero_test_key", (str(src / "a.cpp"),), cuda=False)
    key = build.build_key(spec)
    assert build.build_key(spec) == key
    (src / "a.h").write_text("int a(); // edited\n")  # a header counts too
    edited = build.build_key(spec)
    assert edited != key
    (src / "notes.txt").write_text("not a source")  # nor does anything else in the folder
    assert build.build_key(spec) == edited


def test_cpu_key_ignores_gpu_and_nvcc(fixed_tools, monkeypatch):
    key = build.build_key(build.CPU_ADAM)
    monkeypatch.setattr(build, "nvcc_version", lambda: "13.0.88")
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert build.build_key(build.CPU_ADAM) == key and "sm" not in key


def test_arch_list_parsing():
    assert build.parse_arch_list("8.0;9.0+PTX") == ("80", "90")
    assert build.parse_arch_list("9.0 9.0") == ("90",)
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST='Hopper'"):
        build.parse_arch_list("Hopper")
    with pytest.raises(ValueError, match="names no architecture"):
        build.parse_arch_list(" ; ")


def test_nvcc_version_reads_the_release(monkeypatch, tmp_path):
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    nvcc.chmod(0o755)
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    assert build.nvcc_version() == "12.4.131"
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "none"))
    assert build.nvcc_version() == "missing"


def test_jit_build_gets_the_device_arch_and_holds_the_lock(fixed_tools, monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setenv("MEGAZERO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    seen = {}

    def fake_load(name, sources, build_directory, **kwargs):
        seen.update(kwargs, name=name, build_directory=build_directory)
        with pytest.raises(TimeoutError, match="MEGAZERO_KERNEL_BUILD_TIMEOUT_S"):  # held while building
            with build.build_lock(build.Path(build_directory), timeout_s=0.3):
                pass
        return os.path.join(build_directory, f"{name}.so")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    build.jit_build(build.CUDA_OPS, device=0)
    assert SM90 in seen["extra_cuda_cflags"] and SM80 not in seen["extra_cuda_cflags"]
    assert "sm90" in seen["build_directory"]


def test_build_lock_excludes_times_out_and_clears_a_stale_torch_lock(tmp_path):
    (tmp_path / "lock").write_text("")  # torch's FileBaton left by a killed build: it would make torch wait forever
    with build.build_lock(tmp_path, timeout_s=5):
        assert not (tmp_path / "lock").exists()
        with pytest.raises(TimeoutError, match=str(tmp_path)):
            with build.build_lock(tmp_path, timeout_s=0.3):
                pass
    with build.build_lock(tmp_path, timeout_s=0.3):  # released: taken at once
        pass


def test_build_timeout_setting(monkeypatch):
    monkeypatch.setenv("MEGAZERO_KERNEL_BUILD_TIMEOUT_S", "12")
    assert build.build_timeout_s() == 12.0
    monkeypatch.setenv("MEGAZERO_KERNEL_BUILD_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="MEGAZERO_KERNEL_BUILD_TIMEOUT_S='soon'"):
        build.build_timeout_s()


def test_aot_build_flags_contain_the_arch(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    flags = build.aot_nvcc_flags()
    assert SM80 in flags and SM90 in flags and all(f in flags for f in build.nvcc_flags())
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert SM90 in build.aot_nvcc_flags() and SM80 not in build.aot_nvcc_flags()
    # setup.py's extension list as a CUDA build of torch would make it (no GPU or CUDA torch needed to list it)
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    exts, _ = build.aot_extensions()
    (cuda_ext,) = [e for e in exts if e.name.endswith("_megazero_cuda")]
    assert SM90 in cuda_ext.extra_compile_args["nvcc"]


@pytest.fixture
def cuda_build_fails(monkeypatch, tmp_path):
    """A process that sees a CUDA device whose megazero_cuda build fails, without apex."""
    monkeypatch.setenv("MEGAZERO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEGAZERO_KERNELS", "auto")
    monkeypatch.setattr(loader, "_CACHE", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(loader, "apex", lambda module: None)

    def failing(spec, device):
        raise RuntimeError("layer_norm.cu(12): error: identifier \"x\" is undefined")

    monkeypatch.setattr(loader, "_find_or_build", failing)


def test_failed_cuda_build_falls_back_to_torch_fused_ops(cuda_build_fails, capsys):
    plan = prepare.prepare(torch.device("cuda", 0), ["rms_norm", "layer_norm", "adam_step",
                                                     "scaled_upper_triang_masked_softmax"])
    assert plan == {"rms_norm": "torch", "layer_norm": "torch", "adam_step": "torch",
                    "scaled_upper_triang_masked_softmax": "reference"}
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not build the CUDA kernels" in err[0] and "torch's fused ops" in err[0]
    line = prepare.describe(plan, torch.device("cpu"))
    assert "rms_norm=torch" in line and "adam_step=torch" in line


def test_reference_mode_keeps_the_twins_on_cuda(cuda_build_fails, monkeypatch):
    monkeypatch.setenv("MEGAZERO_KERNELS", "reference")
    assert set(prepare.prepare(torch.device("cuda", 0), ["rms_norm", "layer_norm", "adam_step"]).values()) == {
        "reference"}
    p = [torch.randn(4)]
    shared = dict(beta1=0.9, beta2=0.999, eps=1e-8, adamw_mode=True, bias_correction=True, maximize=False)
    assert adam._cuda_adam(p, [torch.randn(4)], [torch.zeros(4)], [torch.zeros(4)], [], 1, [1e-3], [0.0],
                           shared) is None


def test_cuda_adam_without_kernels_runs_torch_fused_adam(monkeypatch):
    """_cuda_adam (the CUDA branch of adam_step) with no megazero_cuda and no apex: torch's fused AdamW, once
    per (lr, wd), within the Adam tolerance of the twin. Run on CPU tensors: torch's fused kernel has a CPU build."""
    monkeypatch.setenv("MEGAZERO_KERNELS", "auto")
    monkeypatch.setattr(loader, "cuda_ops", lambda device=None: None)
    monkeypatch.setattr(loader, "apex", lambda module: None)
    rtol, atol = reference.TOLERANCES["adam"][torch.float32]
    sizes, lrs, wds = [3, 40, 5], [1e-2, 1e-3, 1e-2], [0.1, 0.0, 0.1]
    for adamw_mode, grad_dtype in ((True, torch.float32), (False, torch.bfloat16)):
        gen = torch.Generator().manual_seed(0)
        params = [torch.randn(n, generator=gen) for n in sizes]
        twin = [p.clone() for p in params]
        states = [[torch.zeros(n) for n in sizes] for _ in range(4)]  # exp_avg, exp_avg_sq for each side
        copies = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        shared = dict(beta1=0.9, beta2=0.95, eps=1e-8, adamw_mode=adamw_mode, bias_correction=True, maximize=False)
        for step in range(1, 21):
            grads = [torch.randn(n, generator=gen).to(grad_dtype) for n in sizes]
            assert adam._cuda_adam(params, grads, states[0], states[1], copies, step, lrs, wds, shared) == "torch"
            for i in range(len(sizes)):
                reference.adam_step(twin[i], grads[i], states[2][i], states[3][i], step=step, lr=lrs[i],
                                    weight_decay=wds[i], **shared)
        for p, t, c in zip(params, twin, copies, strict=True):
            assert torch.allclose(p, t, rtol=rtol, atol=atol * t.abs().max().item())
            assert torch.equal(c, p.to(torch.bfloat16))
    shared["bias_correction"] = False  # torch's kernel always corrects: the caller runs the twin
    assert adam._cuda_adam(params, grads, states[0], states[1], [], 1, lrs, wds, shared) is None


def test_torch_norm_fallbacks_match_the_twins():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 32, generator=gen).to(dtype)
        w, b = torch.randn(32, generator=gen).to(dtype), torch.randn(32, generator=gen).to(dtype)
        rtol, atol = reference.TOLERANCES["layer_norm"][dtype]
        got, want = norm.torch_layer_norm(x, w, b, 1e-5), reference.layer_norm(x, w, b, 1e-5)
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol)
        rtol, atol = reference.TOLERANCES["rms_norm"][dtype]
        got, want = norm.torch_rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5)
        assert got.dtype == dtype and torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol)


def test_cpu_keeps_the_twins():
    assert prepare.backend_of("layer_norm", "cpu") == "reference"
    assert prepare.backend_of("rms_norm", "cpu") == "reference"
    with pytest.raises(ValueError, match="kernel op 'gelu'"):
        prepare.backend_of("gelu", "cpu")


COMM_CALLS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "all_to_all_single", "send", "recv",
              "isend", "irecv", "batch_isend_irecv", "all_gather_object", "barrier")


def _record_initialize_and_step(overrides, steps):
    """On a rank: initialize and train `steps` batches with the loader and every comm call recording their
    order (the loader records its first call per extension and returns None, so the ops run their twins:
    nothing is built)."""
    import megazero
    import megazero.engine as engine_mod
    from megazero.runtime import comm

    os.environ["MEGAZERO_KERNELS"] = "auto"
    events = []
    loader._CACHE.clear()
    cache = {}  # as the loader's: the first call per extension finds, builds or loads it; later ones are lookups

    def extension(spec, device=None):
        if spec.name not in cache:
            events.append(("load", spec.name))
            cache[spec.name] = None
        return cache[spec.name]

    loader.extension = extension
    real_init, real_pctx = engine_mod.init_distributed, engine_mod.ParallelContext
    engine_mod.init_distributed = lambda *a, **k: (events.append(("init_distributed",)), real_init(*a, **k))[1]
    engine_mod.ParallelContext = lambda *a, **k: (events.append(("process_groups",)), real_pctx(*a, **k))[1]
    for name in COMM_CALLS:
        real = getattr(comm, name)
        setattr(comm, name, lambda *a, _real=real, _name=name, **k: (events.append(("comm", _name)),
                                                                    _real(*a, **k))[1])
    engine, _, data, _ = megazero.initialize(config="configs/debug_llama.yaml", overrides=overrides)
    for _ in range(steps):
        engine.train_batch(data)
    return events


def _check_order(events):
    loads = [i for i, e in enumerate(events) if e[0] == "load"]
    assert [events[i] for i in loads] == [("load", "megazero_cpu_adam")], events
    assert loads[0] < events.index(("init_distributed",)) < events.index(("process_groups",))
    assert all(loads[0] < i for i, e in enumerate(events) if e[0] == "comm"), events


def test_initialize_loads_kernels_before_init_distributed(monkeypatch, capsys):
    """One process, optimizer offloaded to the CPU: the CPU Adam is loaded in initialize, before init_distributed
    and the process groups, and rank 0 says which backend each op uses, once."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(loader, "_CACHE", {})
    monkeypatch.setattr(loader, "extension", loader.extension)  # restored after the test
    import megazero.engine as engine_mod
    from megazero.runtime import comm

    for name in ("init_distributed", "ParallelContext"):
        monkeypatch.setattr(engine_mod, name, getattr(engine_mod, name))
    for name in COMM_CALLS:
        monkeypatch.setattr(comm, name, getattr(comm, name))
    events = _record_initialize_and_step(["parallel.pp=1", "parallel.tp=1", "data.path=null", "zero.stage=2",
                                          "zero.offload_optimizer.device=cpu", "model.layers=2"], steps=0)
    _check_order(events)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megazero kernels")]
    assert said == ["megazero kernels (cpu, MEGAZERO_KERNELS=auto): rms_norm=reference, adam_step=reference"]


def test_every_rank_loads_kernels_before_its_first_collective():
    """Two pipeline stages (gloo): each rank loads its kernels in initialize, before its first collective or
    p2p of initialize and of a training step (the later stage's first receive included). Before, the CPU Adam
    loaded at the first optimizer step, after every collective of the step."""
    from tests.harness import run_ranks

    overrides = ["parallel.pp=2", "parallel.tp=1", "data.path=null", "model.layers=2", "train.global_batch_size=4"]
    for events in run_ranks(_record_initialize_and_step, 2, overrides, 1):
        assert any(e[0] == "comm" for e in events)
        _check_order(events)


def test_kernel_ops_follow_the_config():
    from megazero.engine import load_run_config
    from megazero.engine.kernel_plan import kernel_ops

    llama = load_run_config("configs/debug_llama.yaml", ["parallel.pp=1", "parallel.tp=1"], world_size=1)
    assert kernel_ops(llama) == ["rms_norm", "adam_step"]
    gpt = load_run_config("configs/debug_gpt.yaml", ["parallel.pp=1", "parallel.tp=1", "optimizer.type=sgd",
                                                     "model.overrides.attention_dropout=0.1"], world_size=1)
    assert kernel_ops(gpt) == ["layer_norm", "scaled_upper_triang_masked_softmax"]
    assert kernel_ops(llama, torch.nn.Linear(2, 2)) == ["layer_norm", "rms_norm",
                                                        "scaled_upper_triang_masked_softmax", "adam_step"]


LOCK_CHILD = """
import importlib.util, sys, time
from pathlib import Path
spec = importlib.util.spec_from_file_location("build", sys.argv[1])
build = sys.modules["build"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(build)
with build.build_lock(Path(sys.argv[2]), timeout_s=60, poll_s=0.02):
    with open(sys.argv[3], "a") as log:
        log.write("start\\n")
        log.flush()
        time.sleep(0.3)
        log.write("end\\n")
"""


def test_build_lock_serialises_processes(tmp_path):
    """Three processes (stdlib only: build.py imports no torch at module level) take the lock over one
    directory at once: their critical sections never overlap."""
    import subprocess
    import sys

    log = tmp_path / "log"
    procs = [subprocess.Popen([sys.executable, "-c", LOCK_CHILD, build.__file__, str(tmp_path / "dir"), str(log)])
             for _ in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    assert log.read_text().split() == ["start", "end"] * 3


TINY_EXT = """
#include <torch/library.h>
#include <ATen/ATen.h>
at::Tensor norm_fwd(const at::Tensor& x) { return x * 2; }
TORCH_LIBRARY(megazero_test_lock, m) { m.def("norm_fwd(Tensor x) -> Tensor", &norm_fwd); }
"""

BUILD_CHILD = """
import sys, torch
from megazero.runtime.kernels import build, loader
ops = loader.extension(build.ExtSpec("megazero_test_lock", (sys.argv[1],), cuda=False))
print(ops.norm_fwd(torch.ones(2)).tolist())
"""


def test_two_ranks_build_one_extension_once(tmp_path):
    """Two processes of one node load an extension that is not built yet, from one cache: both load it, the
    sources are compiled once (ninja's log), and neither prints a build failure."""
    import subprocess
    import sys

    src = tmp_path / "src" / "tiny.cpp"
    src.parent.mkdir()
    src.write_text(TINY_EXT)
    env = {**os.environ, "PYTHONPATH": str(build.REPO_ROOT), "MEGAZERO_CACHE_DIR": str(tmp_path / "cache"),
           "MEGAZERO_KERNELS": "strict", "MAX_JOBS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_CHILD, str(src)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["[2.0, 2.0]"] * 2
    (ninja_log,) = (tmp_path / "cache" / "ext").rglob(".ninja_log")
    outputs = [line.split("\t")[3] for line in ninja_log.read_text().splitlines() if not line.startswith("#")]
    assert outputs.count("tiny.o") == 1, ninja_log.read_text()
