"""L1, plumbing: process groups, counted collectives, kernel dispatch.

- `parallel_context`: `ParallelContext` builds every process group once from a `Topology`;
- `comm`: typed collectives and p2p over an explicit `GroupHandle`, with byte counters and timeouts;
- `kernels/`: the one dispatch point for fused kernels (built extension -> apex -> torch's fused ops on CUDA,
  the PyTorch reference on CPU).

Import the submodules directly; this file imports nothing.
"""


def __getattr__(name: str):
    """DeepSpeed scripts reach `deepspeed.runtime.utils.set_random_seed`, `deepspeed.runtime.pipe` and
    `deepspeed.runtime.zero` by attribute after ``import megazero as deepspeed``: those subpackages (L4 re-exports of
    DeepSpeed's paths, see tests/test_layering.py) load on first access. Nothing of L1 uses them."""
    if name in ("utils", "pipe", "zero"):
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
