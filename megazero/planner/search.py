"""`--search`: every layout of a model on N GPUs and a global batch, ranked by predicted throughput.

`candidates` generates the layouts (nothing hand-picked): tp over the divisors of the GPUs per node
that divide the heads, KV heads and FFN (TP stays inside a node: its collectives are on the critical
path); pp over the divisors of GPUs / tp up to the layers (the trainer splits the L + 2 pipeline layers
unevenly where they do not divide); context parallelism for a long sequence (`LONG_SEQUENCE` tokens or more:
cp over the powers of 2 that divide GPUs / (tp x pp) and cut the sequence into 2·cp chunks, the ring and,
where the heads per TP rank divide, Ulysses; cp 1 below it); dp the rest; micro-batches of 1, 2, 4, 8 that divide
the batch per dp rank; ZeRO 1-3 (ZeRO-0 moves the same bytes as ZeRO-1 and holds more; one stage when dp x cp = 1:
nothing to shard); recompute none / selective / full; the schedules 1F1B, ZB-H1 and interleaved with
2, 3, 4, 6 or 8 chunks where the layers fill them (GPipe has 1F1B's bubble and holds every
micro-batch's activations); when pp > 1 the partitions uniform, flops and parameters (the trainer's
methods; flops and parameters give the stages holding the embedding and the head fewer blocks) and,
where the blocks divide, equal blocks per stage (Megatron's split, as a count list);
sequence parallelism whenever tp > 1 (it only saves memory and replaces each all-reduce by a
reduce-scatter plus an all-gather of the same volume), except for a Mixture-of-Experts model, which
the runtime runs without it; for an MoE model every ep that divides dp and the experts (fewer experts
per rank: less memory, more all-to-all), expert_tp at its default (tp) unless fixed; offload of the
optimizer (and at ZeRO-3 of the parameters) as a last resort, only when asked (``offload=True``).
Fixed choices (e.g. ``tp=8``) restrict the generation. `rank` keeps the layouts that fit, fastest
first, and says for each rejected one why.
"""
from __future__ import annotations

from typing import Iterator

from megazero.planner.layout import Layout
from megazero.planner.stages import partition_bounds

MICRO_BATCHES = (1, 2, 4, 8)
CHUNKS = (2, 3, 4, 6, 8)
"""Interleaved chunk counts tried (by `--search`, and by plan.py when ``--schedule interleaved`` gives none)."""
LONG_SEQUENCE = 16384
"""From this many tokens per sequence `--search` tries context parallelism (Llama 3 trained its 8K stage without
it and its 128K stage with cp 16); a fixed ``cp`` is tried at any length."""
PARTITIONS = ("uniform", "flops", "parameters")
"""Pipeline partitions tried when pp > 1 (the trainer's methods; a count list is only ever given)."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(spec, gpus: int, global_batch: int, gpus_per_node: int, fixed: dict | None = None,
               offload: bool = False, precision: str = "bf16") -> Iterator[Layout]:
    """Every layout of `spec` on `gpus` GPUs for `global_batch` that `Layout.problems` accepts, with
    the choices in `fixed` (Layout field -> value) held."""
    fixed = dict(fixed or {})

    def options(name, values):
        return [fixed[name]] if name in fixed else list(values)

    tps = options("tp", [t for t in _divisors(gpus_per_node) if gpus % t == 0])
    for tp, pp in ((tp, pp) for tp in tps for pp in options("pp", [p for p in _divisors(gpus // tp)
                                                                   if p <= spec.layers])):
        if gpus % (tp * pp):
            continue
        for cp, method in _cps(spec, gpus // (tp * pp), tp, fixed):
            dp = gpus // (tp * pp * cp)
            if gpus % (tp * pp * cp) or ("dp" in fixed and fixed["dp"] != dp):
                continue
            for ep, mb in ((ep, mb) for ep in options("ep", _eps(spec, dp))
                           for mb in options("micro_batch", MICRO_BATCHES)):
                if global_batch % (mb * dp):
                    continue
                for zero in options("zero", _zero_stages(dp * cp, fixed)):
                    for recompute in options("recompute", ("none", "selective", "full")):
                        for (schedule, chunks), part in ((sc, pa) for sc in _schedules(spec, pp, fixed)
                                                         for pa in _partitions(spec, pp, sc[1], fixed)):
                            for sp in options("sequence_parallel", (tp > 1 and spec.moe is None,)):
                                for off_opt, off_param in _offloads(zero, offload, fixed):
                                    layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=global_batch,
                                                    zero=zero, recompute=recompute, schedule=schedule,
                                                    chunks=chunks, partition=part, sequence_parallel=sp,
                                                    offload_optimizer=off_opt, offload_param=off_param,
                                                    precision=fixed.get("precision", precision), ep=ep,
                                                    expert_tp=fixed.get("expert_tp"),
                                                    moe_imbalance=fixed.get("moe_imbalance", 1.0), cp=cp,
                                                    cp_method=method,
                                                    **{k: fixed[k] for k in COMM_FIELDS if k in fixed})
                                    if not layout.problems(spec):
                                        yield layout


COMM_FIELDS = ("hierarchical", "ranks_per_node", "onebit", "quantized_weights", "hpz", "quantized_gradients")
"""Layout fields a search holds as given (never searched)."""


def _zero_stages(dp: int, fixed: dict) -> tuple[int, ...]:
    """ZeRO stages to try: 1-3 (1 alone when the dp (x cp) ranks ZeRO shards over are one); 0 with 1-bit Adam; 3
    with a ZeRO++ option."""
    if fixed.get("onebit"):
        return (0,)
    if fixed.get("quantized_weights") or fixed.get("quantized_gradients") or fixed.get("hpz", 1) != 1:
        return (3,)
    return (1, 2, 3) if dp > 1 else (1,)


def _cps(spec, ranks: int, tp: int, fixed: dict) -> list[tuple[int, str]]:
    """(cp, cp_method) to try over `ranks` = GPUs / (tp x pp): cp 1 for a sequence shorter than `LONG_SEQUENCE`,
    else the powers of 2 that divide the ranks and cut the sequence into 2·cp chunks, each with the ring and,
    where the heads per TP rank divide, Ulysses (Layout.problems drops what the runtime refuses)."""
    if "cp" in fixed:
        cps = [fixed["cp"]]
    elif spec.seq_len < LONG_SEQUENCE or spec.dropout or spec.attention_dropout or \
            (spec.moe is not None and spec.moe.capacity_factor is not None):
        cps = [1]
    else:
        cps = [c for c in (2 ** i for i in range(ranks.bit_length())) if ranks % c == 0 and spec.seq_len % (2 * c) == 0]
    out = []
    for cp in cps:
        methods = ["ring"] + (["ulysses"] if cp > 1 and (spec.heads // tp) % cp == 0 else [])
        out += [(cp, m) for m in ([fixed["cp_method"]] if "cp_method" in fixed else methods)]
    return out


def _eps(spec, dp: int) -> list[int]:
    """Expert-parallel sizes to try: 1 for a dense model; else the divisors of dp that divide the experts."""
    if spec.moe is None:
        return [1]
    return [e for e in _divisors(dp) if spec.moe.num_experts % e == 0]


def _schedules(spec, pp: int, fixed: dict):
    """(schedule, chunks): every chunk count of `CHUNKS` whose pp x V parts the L + 2 layers can fill."""
    interleaved = [("interleaved", v) for v in CHUNKS if pp * v <= spec.layers + 2]
    if "schedule" in fixed:
        if fixed["schedule"] == "interleaved" and "chunks" not in fixed:
            yield from interleaved
        else:
            yield fixed["schedule"], fixed.get("chunks", 1)
        return
    if pp == 1:
        yield "1f1b", 1  # one stage: every schedule is the same
        return
    yield from (("1f1b", 1), ("zb-h1", 1))
    yield from interleaved


def _partitions(spec, pp: int, chunks: int, fixed: dict) -> list:
    """The partitions to try: the fixed one, else those of `PARTITIONS` and, when the blocks divide, equal
    blocks per virtual stage (Megatron's split: the embedding and the head join the end stages) that split the
    layers differently (the first of equal splits kept; none when the layers cannot fill pp x chunks parts)."""
    if "partition" in fixed:
        return [fixed["partition"]]
    if pp == 1:
        return ["uniform"]
    seen, out = set(), []
    parts = pp * chunks
    even = [(spec.layers // parts,) * parts] if spec.layers % parts == 0 else []  # Megatron's: equal blocks
    for part in list(PARTITIONS) + even:
        try:
            bounds = partition_bounds(spec, Layout(pp=pp, chunks=chunks, partition=part))
        except ValueError:
            continue
        if bounds not in seen:
            seen.add(bounds)
            out.append(part)
    return out


def _offloads(zero: int, offload: bool, fixed: dict):
    if "offload_optimizer" in fixed or "offload_param" in fixed:
        yield fixed.get("offload_optimizer", False), fixed.get("offload_param", False)
        return
    yield False, False
    if offload and zero >= 1:
        yield True, False
        if zero == 3:
            yield True, True
