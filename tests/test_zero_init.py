"""`megazero.zero.Init` and `GatheredParameters` (DeepSpeed's names) on 8 ranks.

A GPT-2-shaped megazero model (16 layers, hidden 512: 50.6M parameters, 193 MiB of fp32 weights) is
built inside `zero.Init()` and trained under ZeRO-3 within a per-rank budget of 4/5 of its fp32
weights: each rank's resident set, from before the build to the end of the second step, never rises
by more than that. The build holds one layer in full at a time, then only its 1/8 partitions; the
step holds the ZeRO-3 states (2 of the 16 bytes per parameter of weights, gradients, Adam moments)
plus a working set bounded by the bucket sizes and the activations, not by the model.

A plain build alone already exceeds the budget on every rank. On a small model of the same family,
an Init-built model trains exactly as a plain build does (the same losses, bit for bit: Init keeps
the same initial values), `GatheredParameters` shows every rank the full values, and what
`modifier_rank` writes is kept, before and after `initialize`.
"""

import torch

from tests.harness import run_ranks

SPEC = {"layers": 16, "hidden": 512, "heads": 8, "vocab": 257, "seq_len": 32}
BUDGET = 0.85  # of the model's fp32 weights, per rank (the docstring's measured parts)
CFG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
       "zero_optimization": {"stage": 3, "reduce_bucket_size": 500_000, "stage3_prefetch_bucket_size": 500_000,
                             "stage3_param_persistence_threshold": 10_000}}


def _kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _reset_peak() -> int:
    """Reset the resident-set peak (Linux's clear_refs); returns the resident set now, in bytes."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _kib("VmRSS") * 1024


def _peak_since(base: int) -> int:
    """Bytes the resident set has peaked above `base` since the last `_reset_peak`."""
    return _kib("VmHWM") * 1024 - base


def worker():
    import torch.distributed as dist

    import megazero
    from megazero.core.spec import load_spec
    from tests.harness import mmap_large_allocations

    mmap_large_allocations()
    from megazero.models import CausalLM
    from megazero.runtime.comm import single_rank_group

    spec = load_spec("model_specs/gpt.py:debug", SPEC)
    megazero.init_distributed()

    def build(partitioned, spec=spec):
        if not partitioned:
            return CausalLM(spec, single_rank_group("tp"), seed=0)
        with megazero.zero.Init():
            return CausalLM(spec, single_rank_group("tp"), seed=0)

    def train(model):
        engine, *_ = megazero.initialize(model=model, config=CFG)
        losses = []
        for step in range(2):  # two steps: the second uses the first's update
            tokens = torch.randint(0, SPEC["vocab"], (8, 33), generator=torch.Generator().manual_seed(step))
            mine = tokens[engine.pctx.dp_rank:engine.pctx.dp_rank + 1]
            loss, _ = engine(mine[:, :-1], mine[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    # A small model first (it also pays for imports and first calls): Init keeps a plain build's
    # values and training, and GatheredParameters reads and writes the full values.
    small = spec.replace(layers=2, hidden=64, heads=4)
    partitioned, plain = build(True, small), build(False, small)
    word, plain_word = partitioned.embedding.word.weight, plain.embedding.word.weight
    shard_numel, full_numel = word.numel(), plain_word.numel()
    with megazero.zero.GatheredParameters(word):
        gathered_equal = torch.equal(word, plain_word)
    losses = train(partitioned), train(plain)
    with megazero.zero.GatheredParameters(word, modifier_rank=0):
        if dist.get_rank() == 0:
            word.data.mul_(2.0)
    with megazero.zero.GatheredParameters(word):
        doubled = word.detach().clone()
    with megazero.zero.GatheredParameters(plain_word):
        doubled = torch.allclose(doubled, 2 * plain_word)
    del partitioned, plain, word, plain_word

    base = _reset_peak()  # the budget's window: the Init build, initialize and two ZeRO-3 steps
    partitioned = build(True)
    init_peak = _peak_since(base)
    train(partitioned)
    budget_peak = _peak_since(base)
    del partitioned

    base = _reset_peak()
    plain = build(False)
    plain_peak = _peak_since(base)
    full_bytes = 4 * sum(p.numel() for p in {id(p): p for p in plain.parameters()}.values())
    return {"init_peak": init_peak, "budget_peak": budget_peak, "plain_peak": plain_peak, "full": full_bytes,
            "shard": (shard_numel, full_numel), "gathered_equal": gathered_equal, "losses": losses,
            "doubled": doubled}


def test_zero_init_builds_partitioned_and_trains_within_the_budget_like_a_plain_build():
    for rank, r in enumerate(run_ranks(worker, 8, timeout=300)):
        mib = {k: r[k] / 2**20 for k in ("init_peak", "budget_peak", "plain_peak", "full")}
        print(f"rank {rank}: model {mib['full']:.1f} MiB, budget {BUDGET * mib['full']:.1f} MiB; Init build "
              f"+{mib['init_peak']:.1f} MiB, build and two ZeRO-3 steps +{mib['budget_peak']:.1f} MiB; "
              f"plain build +{mib['plain_peak']:.1f} MiB")
        assert r["plain_peak"] > BUDGET * r["full"], r  # the model does not fit the budget built plainly
        assert r["init_peak"] < r["full"] / 4, r
        assert r["budget_peak"] < BUDGET * r["full"], r
        shard, full = r["shard"]
        assert shard == -(-full // 8) or (rank == 7 and shard == full - 7 * -(-full // 8))  # 1/8 of the embedding
        assert r["gathered_equal"] and r["doubled"]
        init_losses, plain_losses = r["losses"]
        assert init_losses == plain_losses


def test_partitions_live_on_the_local_accelerator(monkeypatch):
    """As DeepSpeed's, Init keeps partitions on this rank's accelerator (so the all-gathers and the
    modifier's broadcast run on NCCL), the host only with remote_device="cpu". No CUDA here: the
    device choice is checked with CUDA reported present, and every partition is seen going to it."""
    from megazero.zero import partitioned_init

    monkeypatch.setattr(partitioned_init.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(partitioned_init.torch.cuda, "current_device", lambda: 3)
    assert partitioned_init.local_device(None) == torch.device("cuda", 3)
    assert partitioned_init.local_device("cpu") == torch.device("cpu")
    placed = []
    real = partitioned_init.partition

    def spy(p, rank, size, device=None):
        placed.append(device)
        real(p, rank, size, torch.device("cpu"))  # where the test can run

    monkeypatch.setattr(partitioned_init, "partition", spy)
    with partitioned_init.Init():
        torch.nn.Linear(6, 3)
    assert placed == [torch.device("cuda", 3)] * 2
    with partitioned_init.Init(remote_device="cpu"):
        torch.nn.Linear(6, 3)
    assert placed[2:] == [torch.device("cpu")] * 2
