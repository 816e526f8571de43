"""The cases of benchmarks/run.py: one module per case, each with `case(args) -> dict` and its
per-rank worker functions."""
