"""DeepSpeed's MoE layer for a user's expert (`megazero.moe.layer.MoE`, `megazero.moe.gating`,
`megazero.moe.utils`).

- (a) the gating equals DeepSpeed 0.19.8's own `top1gating` / `top2gating` (imported and run here on
  CPU) under the same seed: combine weights and dispatch mask (the same decisions: experts, slots,
  capacity, drops), l_aux, exp_counts and the gradient of a loss of the combine weights and l_aux
  towards the logits; top-1 with and without Random Token Selection, RSample noise, used_token,
  min_capacity and drop_tokens=False; top-2 with and without second-expert sampling and dropping;
- (b) the layer at ep 2 and ep 4 (gloo, under the order check) equals the same layer at ep 1 in one
  process: each rank's output, l_aux, exp_counts and input gradient equal ep 1 on that rank's tokens,
  the gate's (and PR-MoE's residual MLP's and coefficient's) gradients too, and each expert's gradient
  equals the sum over ranks of ep 1's, for top-1 and top-2, dropping and not, with noise and residual;
- (c) `split_params_into_different_moe_groups_for_optimizer`, `is_moe_param` and friends return what
  DeepSpeed's return for the same parameters (its module run on a DeepSpeed MoE model and ours on the
  same model built with megazero's layer);
- the options megazero refuses are refused by name.
"""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from megazero.moe import gating
from megazero.moe.layer import MoE
from tests.harness import run_ranks

ds_moe = pytest.importorskip("deepspeed.moe.sharded_moe")


def dense_combine(g: gating.Gating, num_experts: int) -> torch.Tensor:
    """DeepSpeed's combine_weights (S, E, C) of a `Gating`: gate of route j at [s, expert, slot]."""
    k, S = g.indices.shape
    out = torch.zeros(S, num_experts, g.capacity)
    for j in range(k):
        kept = g.indices[j] >= 0
        s = torch.arange(S)[kept]
        out = out.index_put((s, g.indices[j][kept], g.locations[j][kept]), g.gates[j][kept], accumulate=True)
    return out


TOP1 = {  # name: (tokens, experts, capacity_factor, min_capacity, kwargs)
    "rts": (32, 4, 1.0, 4, {}),
    "no-rts": (32, 4, 1.0, 4, {"use_rts": False}),
    "rsample": (30, 6, 1.25, 2, {"noisy_gate_policy": "RSample"}),
    "used-token": (24, 4, 0.75, 1, {"used_token": "mask"}),
    "min-capacity": (16, 8, 0.5, 5, {}),
    "no-drop": (32, 4, 1.0, 4, {"drop_tokens": False}),
}
TOP2 = {
    "sampling": (32, 4, 1.0, 4, {}),
    "no-sampling": (32, 4, 1.0, 4, {"top2_2nd_expert_sampling": False}),
    "tight": (40, 8, 0.5, 1, {}),
    "no-drop": (32, 4, 1.0, 4, {"drop_tokens": False}),
}


def _compare(mine: gating.Gating, theirs, logits_mine, logits_theirs, E, seed):
    l_aux, combine, dispatch, counts = theirs
    ours = dense_combine(mine, E)
    assert ours.shape == combine.shape
    assert torch.equal(ours.bool(), dispatch)  # the same decisions: expert, slot, kept or dropped
    torch.testing.assert_close(ours, combine, rtol=0, atol=0)
    assert torch.equal(mine.l_aux, l_aux)
    assert torch.equal(mine.exp_counts, counts)
    w = torch.randn(combine.shape, generator=torch.Generator().manual_seed(seed))
    ((ours * w).sum() + 0.3 * mine.l_aux).backward()
    ((combine * w).sum() + 0.3 * l_aux).backward()
    torch.testing.assert_close(logits_mine.grad, logits_theirs.grad, rtol=1e-6, atol=1e-7)
    return (combine > 0).sum().item(), counts.sum().item()


@pytest.mark.parametrize("name", list(TOP1))
def test_top1_gating_equals_deepspeeds(name):
    S, E, cf, cmin, kw = TOP1[name]
    kw = dict(kw)
    if kw.get("used_token") == "mask":
        kw["used_token"] = (torch.arange(S) % 5 != 0).long()
    for seed in range(3):
        base = torch.randn(S, E, generator=torch.Generator().manual_seed(10 + seed)) * 2
        a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
        torch.manual_seed(seed)
        mine = gating.top1gating(a, cf, cmin, **kw)
        torch.manual_seed(seed)
        theirs = ds_moe.top1gating(b, cf, cmin, **kw)
        kept, chosen = _compare(mine, theirs, a, b, E, seed)
        if name not in ("no-drop", "min-capacity"):
            assert kept < chosen  # capacity dropped some tokens: the selection was exercised


@pytest.mark.parametrize("name", list(TOP2))
def test_top2_gating_equals_deepspeeds(name):
    S, E, cf, cmin, kw = TOP2[name]
    for seed in range(3):
        base = torch.randn(S, E, generator=torch.Generator().manual_seed(20 + seed)) * 2
        a, b = base.clone().requires_grad_(), base.clone().requires_grad_()
        torch.manual_seed(seed)
        mine = gating.top2gating(a, cf, cmin, **kw)
        torch.manual_seed(seed)
        theirs = ds_moe.top2gating(b.clone(), cf, cmin, **kw)  # DeepSpeed adds its noise to the logits in place
        kept, chosen = _compare(mine, theirs, a, b, E, seed)
        assert torch.equal(a.detach(), base)  # ours leaves the logits as they were
        if name == "tight":
            assert kept < chosen


def test_gate_noise_and_eval_capacity_as_deepspeeds_gate():
    """The whole gate module (Jitter on its input in training, eval_capacity_factor in eval) against
    DeepSpeed's TopKGate with the same weight."""
    S, M, E = 40, 8, 4
    x = torch.randn(S, M, generator=torch.Generator().manual_seed(1))
    for k, policy, training in itertools.product((1, 2), ("Jitter", None), (True, False)):
        layer = MoE(M, nn.Linear(M, M), num_experts=E, k=k, capacity_factor=0.5, eval_capacity_factor=2.0,
                    min_capacity=1, noisy_gate_policy=policy)
        ds_gate = ds_moe.TopKGate(M, E, k, 0.5, 2.0, 1, policy)
        ds_gate.wg.weight.data.copy_(layer.deepspeed_moe.gate.wg.weight.data)
        layer.train(training), ds_gate.train(training)
        torch.manual_seed(5)
        g = layer.deepspeed_moe.gate(x, None, None)
        torch.manual_seed(5)
        l_aux, cap, _, idx, loc, gates_, counts = ds_gate(x, None, True)
        assert g.capacity == int(cap) and torch.equal(g.indices, idx.long()) and torch.equal(g.exp_counts, counts)
        assert torch.equal(g.locations[g.indices >= 0], loc.long()[idx >= 0])
        assert torch.equal(g.gates, gates_) and torch.equal(g.l_aux, l_aux)


def test_the_layer_equals_deepspeeds_layer_at_ep1():
    """DeepSpeed's whole MoE module (ep 1, CPU, no process group needed) and ours, same seed: the same
    parameters by name, outputs, l_aux, exp_counts and gradients, top-1 and top-2, residual or not."""
    from deepspeed.moe.layer import MoE as DsMoE

    M = 8
    x = torch.randn(3, 10, M, generator=torch.Generator().manual_seed(2))
    for k, residual in itertools.product((1, 2), (False, True)):
        layers = []
        for cls in (MoE, DsMoE):
            torch.manual_seed(0)
            expert = nn.Sequential(nn.Linear(M, 12), nn.GELU(), nn.Linear(12, M))
            layers.append(cls(M, expert, num_experts=4, k=k, min_capacity=2, use_residual=residual))
        ours, theirs = layers
        assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
        for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert torch.equal(p, q), n  # the same initial values: created in DeepSpeed's order
        results = []
        for layer in (ours, theirs):
            xi = x.clone().requires_grad_()
            torch.manual_seed(9)
            out, l_aux, counts = layer(xi)
            (out.square().sum() + l_aux).backward()
            results.append((out, l_aux, counts, xi.grad, [p.grad for p in layer.parameters()]))
        for a, b in zip(results[0][:4], results[1][:4]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(results[0][4], results[1][4]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
