"""L1, plumbing: process groups, counted collectives, kernel dispatch.

- `parallel_context`: `ParallelContext` builds every process group once from a `Topology`;
- `comm`: typed collectives and p2p over an explicit `GroupHandle`, with byte counters and timeouts;
- `kernels/`: the one dispatch point for fused kernels (built extension -> apex -> torch's fused ops on CUDA,
  the PyTorch reference on CPU).

Import the submodules directly; this file imports nothing.
"""
