"""`megazero.zero.Init` and `GatheredParameters` (DeepSpeed's names) on 8 ranks.

A GPT-2-shaped megazero model (6 layers, hidden 384: 10.8M parameters, 41 MiB of fp32 weights)
built inside `zero.Init()`: each rank's resident memory rises by less than half the model while it
is built (one layer in full at a time, then only its 1/8 partitions), where a plain build takes the
whole model on every rank. It then trains under ZeRO-3 exactly as the plain build does (the same
losses, bit for bit: Init keeps the same initial values). `GatheredParameters` shows every rank the
full values, and what `modifier_rank` writes is kept, before and after `initialize`.
"""
import os

import torch

from tests.harness import run_ranks

SPEC = {"layers": 6, "hidden": 384, "heads": 6, "vocab": 257, "seq_len": 32}
CFG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
       "zero_optimization": {"stage": 3, "reduce_bucket_size": 1_000_000, "stage3_prefetch_bucket_size": 1_000_000,
                             "stage3_param_persistence_threshold": 10_000}}


def _kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _peak_of(fn):
    """(fn(), bytes the resident set peaked above its size at the call); Linux's clear_refs reset."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _kib("VmRSS")
    out = fn()
    return out, (_kib("VmHWM") - before) * 1024


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
        return engine, losses

    build(True, spec.replace(layers=1, hidden=64, heads=4))  # warm-up: imports are not the model's memory
    partitioned, init_peak = _peak_of(lambda: build(True))
    word = partitioned.embedding.word.weight
    shard_shape = tuple(word.shape)
    with megazero.zero.GatheredParameters(word):
        gathered = word.detach().clone()
    plain, plain_peak = _peak_of(lambda: build(False))
    after_build = plain.embedding.word.weight.detach().clone()
    full_bytes = 4 * sum(torch.Size(p.full_shape).numel() for p in {id(p): p for p in plain.parameters()}.values())
    _, plain_losses = train(plain)
    engine, init_losses = train(partitioned)
    with megazero.zero.GatheredParameters(word, modifier_rank=0):
        if dist.get_rank() == 0:
            word.data.mul_(2.0)
    with megazero.zero.GatheredParameters(word):
        doubled = word.detach().clone()
    with megazero.zero.GatheredParameters(plain.embedding.word.weight):
        after = plain.embedding.word.weight.detach().clone()
    return {"init_peak": init_peak, "plain_peak": plain_peak, "full": full_bytes, "shard_shape": shard_shape,
            "gathered_equal": torch.equal(gathered, after_build),
            "losses": (init_losses, plain_losses), "doubled": torch.allclose(doubled, 2 * after)}


def test_zero_init_builds_partitioned_and_trains_like_a_plain_build():
    for rank, r in enumerate(run_ranks(worker, 8, timeout=300)):
        print(f"rank {rank}: built under Init +{r['init_peak'] / 2**20:.1f} MiB, plain +{r['plain_peak'] / 2**20:.1f} "
              f"MiB, model {r['full'] / 2**20:.1f} MiB")
        assert r["init_peak"] < r["full"] / 2 and r["plain_peak"] > r["full"], r
        assert r["shard_shape"] == (384 * 384 // 8,)  # 1/8 of the embedding (vocab 257 padded to 384 rows)
        assert r["gathered_equal"] and r["doubled"]
        init_losses, plain_losses = r["losses"]
        assert init_losses == plain_losses
