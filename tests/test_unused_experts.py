"""A model whose graph depends on the data issues the same collectives on every rank (issue 30).

NCCL matches collectives by their position on a communicator: a rank that skips a gradient bucket's
reduction, reduces the buckets in another order, or gathers a ZeRO-3 unit the others do not, hangs the
group or sums different buckets together. gloo often hides it, so each rank records the sequence of
collectives it issues (kind, group, dtype, element count; by wrapping torch.distributed's functions
inside the rank) and the test compares the sequences of every group's members.

- `MixtralStyle`: Hugging Face Mixtral's sparse MoE block as a plain nn.Module (experts are separate
  modules in a ModuleList, an expert that gets no token is skipped, so its parameters get no gradient on
  that rank), driven by `megazero.initialize` with a DeepSpeed-style config on 2 dp ranks whose data
  leave an expert unused on one rank and used on the other, at ZeRO 1, 2, 3, with and without
  overlap_comm: identical sequences, and the parameters after 2 steps equal one process's
  torch.optim.AdamW on the global batch within 1e-5.
- Expert tensor parallelism: the experts' TP all-reduces run on a rank whose experts have 0 rows (a
  rank never skips a collective its TP peers issue), and the spec MoE model at ep=2, tp=2 (experts' ffn
  split over TP), routed so that ep rank 1's experts get no token, issues the same sequence on every
  group's members and equals the serial run.
- The MoE combine and the rows' gather's backward do not depend on the order of the rows (CUDA's
  `index_add` / scatter-add add in no fixed order, so TP replicas' hidden states or replicated
  gradients could differ in the low bits, and the replicas route differently).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_ranks

H, FFN, E, K, V, SEQ, GAS, STEPS = 8, 16, 6, 2, 24, 3, 2, 2
LR = 1e-2


class Expert(nn.Module):
    """Mixtral's expert MLP (w2(silu(w1 x) * w3 x)), no biases."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)
        self.w3 = nn.Linear(H, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoe(nn.Module):
    """Mixtral's sparse MoE block: softmax router, top-k renormalised, each expert run only on the tokens
    routed to it; `hits` records, per forward, the experts that ran."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, E, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(E))
        self.hits: list[frozenset] = []

    def forward(self, x):  # (T, H)
        weights = F.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(weights, K, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        mask = F.one_hot(chosen, E).permute(2, 1, 0)  # (E, K, T)
        hit = [int(e) for e in (mask.sum((1, 2)) > 0).nonzero().flatten()]
        self.hits.append(frozenset(hit))
        for e in hit:  # experts without a token are skipped, as in transformers' Mixtral
            slot, tok = torch.where(mask[e])
            y = self.experts[e](x[tok]) * weights[tok, slot, None]
            out.index_add_(0, tok, y.to(x.dtype))
        return out


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.moe = SparseMoe()

    def forward(self, x):
        return x + self.moe(self.norm(x))


class MixtralStyle(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids).view(-1, H)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)), labels.view(-1))


def model():
    torch.manual_seed(3)
    return MixtralStyle()


def micro_batches(step: int, rank: int):
    """Rank `rank`'s GAS micro-batches (ids, labels) of step `step`, each (1, SEQ): rank 0 draws its tokens
    from the first half of the vocabulary, rank 1 from the second, so that they route differently."""
    g = torch.Generator().manual_seed(100 * step + rank)
    lo = rank * V // 2
    ids = torch.randint(lo, lo + V // 2, (GAS, 1, SEQ + 1), generator=g)
    return [(mb[:, :-1], mb[:, 1:]) for mb in ids]


def reference():
    """One process, torch.optim.AdamW, the global batch of both ranks: the parameters after STEPS."""
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0)
    for step in range(STEPS):
        for rank in range(2):
            for ids, labels in micro_batches(step, rank):
                (m(ids, labels) / (2 * GAS)).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in m.named_parameters()}


RECORDED = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single", "broadcast",
            "all_gather", "reduce_scatter", "barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def record_collectives() -> list:
    """Wrap torch.distributed's collectives in this process: each call appends (kind, group's global
    ranks, dtype, element count) to the returned list (all-to-all: no count, its splits are the ranks' own)."""
    import torch.distributed as dist

    calls = []

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(
                range(dist.get_world_size()))
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            first = tensors[0] if tensors else None
            numel = None if first is None or name == "all_to_all_single" else first.numel()
            calls.append((name, ranks, None if first is None else str(first.dtype), numel))
            return fn(*args, **kwargs)
        return recorded

    for name in RECORDED:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    return calls


def by_group(calls) -> dict:
    out = {}
    for call in calls:
        out.setdefault(call[1], []).append(call)
    return out


def assert_same_sequences(recorded: list[list]) -> None:
    """Every group's members issued the same sequence of collectives; on a difference, name the group,
    the first differing position and both sides."""
    per_rank = [by_group(calls) for calls in recorded]
    groups = set().union(*per_rank)
    for group in sorted(groups):
        seqs = {r: per_rank[r].get(group, []) for r in group}
        first = seqs[group[0]]
        for r, seq in seqs.items():
            if seq != first:
                # zip-unequal: the two sequences differ and may differ in length; the shorter one's end is the default
                pos = next((i for i, (a, b) in enumerate(zip(first, seq)) if a != b), min(len(first), len(seq)))
                mine = first[pos] if pos < len(first) else "(nothing)"
                theirs = seq[pos] if pos < len(seq) else "(nothing)"
                raise AssertionError(f"group {group}: rank {group[0]} and rank {r} differ at collective {pos} of "
                                     f"{len(first)} / {len(seq)}: {mine} vs {theirs}")


def mixtral_worker(zero: dict):
    import torch.distributed as dist

    import megazero

    calls = record_collectives()
    m = model()
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": GAS,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
           "zero_optimization": dict({"reduce_bucket_size": 400, "stage3_param_persistence_threshold": 0,
                                      "stage3_prefetch_bucket_size": 400}, **zero)}
    engine, optimizer, _, _ = megazero.initialize(model=m, config=cfg)
    rank = dist.get_rank()
    for step in range(STEPS):
        for ids, labels in micro_batches(step, rank):
            engine.backward(engine(ids, labels))
            engine.step()
    with optimizer.full_parameters():
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
    hits = [layer.moe.hits for layer in m.layers]
    return list(calls), params, hits


ZERO = [{"stage": s, "overlap_comm": o} for s in (1, 2, 3) for o in (False, True)]


@pytest.fixture(scope="module")
def expected():
    return reference()


@pytest.mark.parametrize("zero", ZERO, ids=[f"zero{z['stage']}-{'overlap' if z['overlap_comm'] else 'plain'}"
                                            for z in ZERO])
def test_mixtral_style_unused_experts(zero, expected):
    results = run_ranks(mixtral_worker, 2, zero, timeout=90)
    hits = [r[2] for r in results]
    # the data really leave an expert unused on one rank that the other rank uses (same forward)
    differ = [(layer, i) for layer in range(2) for i, (a, b) in enumerate(zip(hits[0][layer], hits[1][layer], strict=True))
              if a != b]
    assert differ and any(len(h) < E for layer in hits[0] + hits[1] for h in layer), hits
    assert_same_sequences([r[0] for r in results])
    assert sum(len(r[0]) for r in results) > 0
    for _, params, _ in results:
        assert set(params) == set(expected)
        worst = max((params[n] - expected[n]).abs().max().item() for n in params)
        # fp32 parameters O(0.1-1) against one process: another summation order per step (the parity suites' 1e-5)
        assert worst <= 1e-5, worst


def empty_rows_worker():
    """GroupedExperts with their ffn split over a TP group of 2, both ranks holding 0 rows (an ep rank
    no token was sent to): the collectives each issued, the output's and the rows' gradient's shapes."""
    import torch.distributed as dist

    from megazero.moe.experts import GroupedExperts
    from megazero.runtime.comm import CommStats, GroupHandle

    calls = record_collectives()
    tp = GroupHandle("tp", (0, 1), dist.get_rank(), dist.group.WORLD, CommStats())
    experts = GroupedExperts(H, FFN, "swiglu", 2, 2, 0, "e", seed=1, std=0.02, out_std=0.02, tp_group=tp)
    rows = torch.zeros(0, H, requires_grad=True)
    out = experts(rows, [0, 0])
    out.sum().backward()
    return list(calls), tuple(out.shape), tuple(rows.grad.shape)


def test_expert_tp_all_reduces_run_with_zero_rows():
    results = run_ranks(empty_rows_worker, 2, timeout=60)
    assert_same_sequences([r[0] for r in results])
    for calls, out_shape, grad_shape in results:
        assert out_shape == grad_shape == (0, H)
        # forward: g's all-reduce of the outputs; backward: f's all-reduce of the rows' gradient
        assert [c[0] for c in calls] == ["all_reduce", "all_reduce"], calls


def skewed_run_layout(config: dict, overrides=(), steps: int = 2, record: bool = False):
    """`megazero.toolbox.parity.run_layout` with every router's logits lowered by 30 for the upper half of
    the experts (a constant: the gradients are unchanged), so that no token is routed to them: at ep=2
    the experts of ep rank 1 get 0 rows. With `record`: (collectives issued, rows each GroupedExperts
    call ran, report); else the report."""
    from megazero.moe.experts import GroupedExperts
    from megazero.moe.layer import MoELayer
    from megazero.toolbox.parity import run_layout

    calls = record_collectives() if record else []
    logits_of, run_experts, rows = MoELayer.router_logits, GroupedExperts.forward, []

    def skewed(self, tokens):
        logits = logits_of(self, tokens)
        upper = torch.arange(logits.shape[1], device=logits.device) >= logits.shape[1] // 2
        return logits - 30.0 * upper

    def counted(self, x, counts=None, **kw):
        if getattr(next(self.parameters()), "expert", False):  # routed experts, not a shared one
            rows.append(x.shape[0])
        return run_experts(self, x, counts, **kw)

    MoELayer.router_logits, GroupedExperts.forward = skewed, counted
    report = run_layout(config, overrides, steps)
    return (list(calls), rows, report) if record else report


def spec_moe_config() -> dict:
    return {"precision": "fp32", "parallel": {"tp": 2, "ep": 2, "dp": 2, "expert_tp": 2},
            "model": {"spec": "model_specs/llama.py:debug-moe", "layers": 2},
            "train": {"micro_batch_size": 1, "global_batch_size": 2, "seed": 7},
            "optimizer": {"type": "adamw", "lr": 1e-3, "eps": 1e-6},
            "zero": {"stage": 1, "reduce_bucket_size": 5000}, "log": {"interval": 1000}}


def test_spec_moe_with_expert_tp_and_an_ep_rank_without_rows_matches_serial():
    """debug-moe at ep=2, tp=2 with the experts' ffn split over TP, routed so that ep rank 1's experts get
    no token: their TP all-reduces run with 0 rows, every group's members issue the same collectives,
    and the run equals the serial one."""
    from megazero.toolbox.parity import compare, merge_reports, serial_overrides

    cfg = spec_moe_config()
    results = run_ranks(skewed_run_layout, 4, cfg, (), 2, True, timeout=120)
    assert_same_sequences([r[0] for r in results])
    rows = [r[1] for r in results]
    assert any(n == 0 for ranks in rows for n in ranks) and any(n > 0 for ranks in rows for n in ranks), rows
    serial = run_ranks(skewed_run_layout, 1, cfg, serial_overrides(2), 2, timeout=120)
    verdict = compare(merge_reports([r[2] for r in results]), merge_reports(serial))
    assert all(row["ok"] for row in verdict), verdict


def test_combine_does_not_depend_on_the_order_of_the_rows():
    """Three experts per token (k = 3, where CUDA's index_add is order-free): the combined hidden states
    are bit-identical whatever order the expert outputs arrive in."""
    from megazero.moe.layer import combine

    g = torch.Generator().manual_seed(0)
    tokens, k, h = 64, 3, 32
    token = torch.arange(tokens).repeat_interleave(k)  # (tokens·k,)
    slot = torch.arange(k).repeat(tokens)
    y = torch.randn(tokens * k, h, generator=g) * torch.logspace(-4, 4, tokens * k).unsqueeze(1)
    first = combine(y, token, slot, tokens, k)
    for seed in range(5):
        perm = torch.randperm(tokens * k, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(combine(y[perm], token[perm], slot[perm], tokens, k), first)
    exact = torch.zeros(tokens, h, dtype=torch.float64).index_add(0, token, y.double())
    scale = torch.zeros(tokens, h, dtype=torch.float64).index_add(0, token, y.double().abs())
    assert bool(((first.double() - exact).abs() <= 1e-6 * scale).all())  # fp32 rounding of the k terms


def test_the_rows_gather_sums_its_gradient_whatever_the_order():
    """The gather of the tokens' rows for the experts (`GatherRows`, tokens[token]) sums each token's k row
    gradients in slot order in backward: the tokens' gradient is bit-identical for any order of the rows."""
    from megazero.moe.layer import GatherRows

    tokens, k, h = 64, 3, 32
    token = torch.arange(tokens).repeat_interleave(k)
    slot = torch.arange(k).repeat(tokens)
    grad_rows = torch.randn(tokens * k, h, generator=torch.Generator().manual_seed(1)) * torch.logspace(
        -4, 4, tokens * k).unsqueeze(1)

    def tokens_grad(perm):
        x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(2)).requires_grad_()
        rows = GatherRows.apply(x, token[perm], slot[perm], k)
        assert torch.equal(rows, x.detach()[token[perm]])
        rows.backward(grad_rows[perm])
        return x.grad

    first = tokens_grad(torch.arange(tokens * k))
    for seed in range(5):
        assert torch.equal(tokens_grad(torch.randperm(tokens * k, generator=torch.Generator().manual_seed(seed))), first)
