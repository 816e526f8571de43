"""The MoE MLP (megazero.moe) against an independent reference, and over expert-parallel ranks.

- `route` equals a loop over sequences, tokens and choices: top-k, weights, capacity (first choices
  first, earlier positions first, per sequence), the Switch aux loss and the z-loss;
- one process: `MoELayer` equals a token-by-token reference (each token's kept experts run one at a
  time and are summed with their weights), outputs and every gradient, aux and z losses included,
  with and without expert biases;
- ep = 2 and 4 ranks (gloo): each rank routes its own sequences and holds E/ep experts; outputs,
  losses and gradients (experts: their slice; router: summed over ranks) equal one process running
  all the sequences with all the experts, within 1e-5, with and without token dropping, softmax and
  sigmoid scores, GeLU and SwiGLU, with a shared expert;
- with expert tensor parallelism (ep × tp ranks, each expert's ffn split over TP, biases on) outputs and
  every gradient equal one process, and the router's gradient is the same on every TP rank;
- under activation recompute the replay reuses the forward's routing: recomputed logits perturbed to
  pick other experts leave the gradients as they were (without the record they change);
- the all-to-all bytes the comm stats count equal the formula from the routing;
- the aux loss alone, trained on a router skewed towards one expert, spreads the load.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from megazero.core.moe_spec import MoESpec, MoESpecError
from megazero.moe.layer import MoELayer
from megazero.moe.routing import route
from megazero.runtime.comm import CommStats, single_rank_group, world_group
from tests.harness import run_ranks

S, B, H = 8, 4, 16  # sequence, sequences in the batch (split over ep ranks), hidden


def _spec(**kw):
    base = dict(num_experts=8, ffn=12, top_k=2, activation="swiglu", score="softmax", capacity_factor=None,
                aux_loss_coef=0.1, z_loss_coef=0.01)
    base.update(kw)
    return MoESpec(**base)


def reference_route(logits, s, spec):
    """A loop: per token the top k, per sequence the capacity queues and the losses."""
    E, k = spec.num_experts, spec.top_k
    probs = torch.softmax(logits, -1) if spec.score == "softmax" else torch.sigmoid(logits)
    b = logits.shape[0] // s
    idx, wts, keep = [], [], []
    aux, z = 0.0, torch.logsumexp(logits, -1).square().mean()
    cap = spec.capacity(s)
    for j in range(b):
        seq = probs[j * s:(j + 1) * s]
        top, ind = seq.topk(k, -1)
        w = top / top.sum(-1, keepdim=True) if spec.normalize_topk and k > 1 else top
        used, kept = [0] * E, torch.ones(s, k, dtype=torch.bool)
        for c in range(k):  # first choices first
            for t in range(s):
                e = int(ind[t, c])
                kept[t, c] = cap is None or used[e] < cap
                used[e] += 1
        f = torch.zeros(E)
        for e in ind.flatten().tolist():
            f[e] += 1.0 / (s * k)
        p = seq if spec.score == "softmax" else seq / seq.sum(-1, keepdim=True)
        aux = aux + E * (f * p.mean(0)).sum() / b
        idx.append(ind), wts.append(w), keep.append(kept)
    return torch.cat(idx), torch.cat(wts), torch.cat(keep), aux, z


@pytest.mark.parametrize("score,cf,normalize", [("softmax", None, True), ("softmax", 1.0, True),
                                                ("sigmoid", 1.25, True), ("softmax", 0.5, False)])
def test_route_equals_the_loop(score, cf, normalize):
    spec = _spec(score=score, capacity_factor=cf, normalize_topk=normalize)
    logits = torch.randn(B * S, 8, generator=torch.Generator().manual_seed(3))
    r = route(logits, S, spec)
    idx, w, keep, aux, z = reference_route(logits, S, spec)
    assert torch.equal(r.indices, idx) and torch.equal(r.keep, keep)
    torch.testing.assert_close(r.weights, w)
    torch.testing.assert_close(r.aux_loss, aux)
    torch.testing.assert_close(r.z_loss, z)
    assert r.dropped == int((~keep).sum()) and (r.dropped > 0) == (cf is not None)
    assert torch.equal(r.tokens_per_expert, torch.bincount(idx[keep], minlength=8))


def reference_layer(layer: MoELayer, x):
    """Token by token: out_t = Σ over its kept choices of w · expert(x_t), plus the shared expert."""
    s, b, h = x.shape
    tokens = x.transpose(0, 1).reshape(b * s, h)
    logits = tokens.float() @ layer.router.float().t()
    idx, w, keep, aux, z = reference_route(logits, s, layer.spec)

    def expert(ex, e, v):  # with the biases when the experts have them
        def b(name):
            bias = getattr(ex, f"{name}_bias", None)
            return 0.0 if bias is None else bias[e]
        if layer.spec.activation == "swiglu":
            return ex.down[e] @ (F.silu(ex.gate[e] @ v + b("gate")) * (ex.up[e] @ v + b("up"))) + b("down")
        return ex.fc2[e] @ F.gelu(ex.fc1[e] @ v + b("fc1")) + b("fc2")

    rows = []
    for t in range(b * s):
        acc = torch.zeros(h)
        for c in range(layer.spec.top_k):
            if keep[t, c]:
                acc = acc + w[t, c] * expert(layer.experts, int(idx[t, c]), tokens[t])
        if layer.shared is not None:
            acc = acc + expert(layer.shared, 0, tokens[t])
        rows.append(acc)
    out = torch.stack(rows).view(b, s, h).transpose(0, 1)
    return out, aux, z


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _grads(layer):
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def _set_biases(layer, seed=0):
    """Give every expert bias values (zero at init) that depend only on its logical name and index:
    each rank takes its slice of the logical tensor (ep split on dim 0, TP split on tp_dim)."""
    from megazero.tensor_parallel.init import stable_seed

    for p in layer.parameters():
        if not p.logical_name.endswith("_bias"):
            continue
        full = torch.randn(p.full_shape, generator=torch.Generator().manual_seed(stable_seed(seed, p.logical_name)))
        if getattr(p, "ep_dim", None) is not None:
            full = full.chunk(p.ep_size, 0)[p.ep_rank]
        if p.tp_dim is not None:
            full = full.chunk(p.tp_size, p.tp_dim)[p.tp_rank]
        with torch.no_grad():
            p.copy_(0.1 * full)


@pytest.mark.parametrize("activation,cf,shared,score,bias", [("swiglu", None, 0, "softmax", False),
                                                             ("gelu", 1.0, 1, "softmax", True),
                                                             ("swiglu", 1.0, 2, "sigmoid", True)])
def test_one_process_equals_token_by_token(activation, cf, shared, score, bias):
    spec = _spec(activation=activation, capacity_factor=cf, shared_experts=shared, shared_ffn=6, score=score)
    x, g = _inputs()
    layer = MoELayer(spec, H, single_rank_group("ep"), "layers.0.mlp", seed=7, bias=bias)
    _set_biases(layer)
    assert bias == any(n.endswith("_bias") for n, _ in layer.named_parameters())
    x1 = x.clone().requires_grad_()
    out = layer(x1)
    loss = (out * g).mean()
    loss.backward()  # the attached losses add coef · their gradient
    got = _grads(layer) | {"x": x1.grad}
    for p in layer.parameters():
        p.grad = None
    x2 = x.clone().requires_grad_()
    ref, aux, z = reference_layer(layer, x2)
    ((ref * g).mean() + spec.aux_loss_coef * aux + spec.z_loss_coef * z).backward()
    want = _grads(layer) | {"x": x2.grad}
    # fp32, the same products summed in another order (experts batched vs token by token): rtol 1e-5 is ~80 ulps (2^-23); atol 1e-6 for outputs near 0 (entries are O(1))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.last_routing.aux_loss, aux)
    for name in want:
        # fp32 as above; atol 1e-7 because the gradients of a mean over every output entry are ~100x smaller than the outputs
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)


def _ep_worker(spec_kw, seed):
    """Rank r of P: sequences r·B/P .. of the batch, experts r·E/P ..; returns what the test compares."""
    import torch.distributed as dist

    spec = _spec(**spec_kw)
    P, r = dist.get_world_size(), dist.get_rank()
    x, g = _inputs(seed)
    mine = slice(r * B // P, (r + 1) * B // P)
    stats = CommStats()
    layer = MoELayer(spec, H, world_group(stats), "layers.3.mlp", seed=11, aux_scale=lambda: 1.0 / P)
    xs = x[:, mine].clone().requires_grad_()
    out = layer(xs)
    ((out * g[:, mine]).mean() / P).backward()  # each rank's share of the global mean, as dp averages
    routed = layer.last_routing
    return {"out": out.detach(), "x_grad": xs.grad, "grads": _grads(layer), "aux": routed.aux_loss.item(),
            "z": routed.z_loss.item(), "tokens": routed.tokens_per_expert, "stats": stats.total(op="all_to_all"),
            "sent": _sent_elements(routed, spec, P, r)}


def _sent_elements(routed, spec, P, r):
    """The formula: rows to other ranks (dispatch) and the rows received back out (combine), h each,
    forward and again backward, plus E/P counts to each other rank once."""
    import torch.distributed as dist

    counts = torch.bincount(routed.indices[routed.keep], minlength=spec.num_experts).view(P, -1).sum(1)
    received = torch.empty_like(counts.view(P, 1).expand(P, 1).contiguous())
    dist.all_to_all_single(received, counts.view(P, 1).contiguous())
    out_rows = int(counts.sum() - counts[r])
    back_rows = int(received.sum() - received[r])
    return 2 * (out_rows + back_rows) * H + (P - 1) * spec.num_experts // P


EP_CASES = [(P, kw) for P, kw in itertools.product((2, 4), (
    dict(),
    dict(capacity_factor=1.0, activation="gelu"),
    dict(score="sigmoid", shared_experts=1, shared_ffn=8, capacity_factor=0.75),
))]


@pytest.mark.parametrize("P,kw", EP_CASES)
def test_expert_parallel_equals_one_process(P, kw):
    spec = _spec(**kw)
    x, g = _inputs(5)
    serial = MoELayer(spec, H, single_rank_group("ep"), "layers.3.mlp", seed=11)
    xs = x.clone().requires_grad_()
    out = serial(xs)
    (out * g).mean().backward()
    want = _grads(serial)
    ranks = run_ranks(_ep_worker, P, kw, 5, timeout=120)
    E, local = spec.num_experts, spec.num_experts // P
    # fp32 as in the one-process test: another summation order (tokens split over ranks, all-to-alls in between); atol for near-0 entries of O(1) outputs
    torch.testing.assert_close(torch.cat([rk["out"] for rk in ranks], 1), out, rtol=1e-5, atol=1e-6)
    # atol 1e-8: the input's gradient of a mean over all outputs is ~1e-2 of the outputs' size per entry
    torch.testing.assert_close(torch.cat([rk["x_grad"] for rk in ranks], 1), xs.grad, rtol=1e-5, atol=1e-8)
    # fp32 means of per-rank shares summed here in float64: a few fp32 ulps, 1e-6 leaves ~10x margin
    assert sum(rk["aux"] for rk in ranks) / P == pytest.approx(serial.last_routing.aux_loss.item(), rel=1e-6)
    assert sum(rk["z"] for rk in ranks) / P == pytest.approx(serial.last_routing.z_loss.item(), rel=1e-6)
    assert torch.equal(sum(rk["tokens"] for rk in ranks), serial.last_routing.tokens_per_expert)
    for name, grad in want.items():
        if name.startswith("experts."):  # each rank holds its slice of the experts, with every rank's tokens' gradient
            got = torch.cat([rk["grads"][name] for rk in ranks])
        else:  # router and shared expert: replicated, each rank's share summed (what dp's reduction does)
            got = sum(rk["grads"][name] for rk in ranks)
        # fp32, summed over ranks in another order: ~80 ulps relative; atol 1e-7 for the small entries of gradients of a mean
        torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-7, msg=name)
        if name.startswith("experts."):
            assert all(rk["grads"][name].shape[0] == local for rk in ranks)
    for rk in ranks:  # 3 all-to-alls forward (counts, dispatch, combine) and 2 backward
        assert rk["stats"].calls == 5 and rk["stats"].elements == rk["sent"]
    assert E % P == 0


def test_aux_loss_spreads_a_skewed_router():
    """Tokens share a mean direction the router favours for expert 0: training the router on the aux
    loss alone brings the busiest expert's share of assignments down towards k/E."""
    spec = _spec(aux_loss_coef=1.0, z_loss_coef=0.0)
    layer = MoELayer(spec, H, single_rank_group("ep"), "layers.0.mlp", seed=1)
    g = torch.Generator().manual_seed(2)
    base = torch.randn(H, generator=g)
    with torch.no_grad():
        layer.router[0] += 0.5 * base / base.norm()
    x = base + 0.5 * torch.randn(S, 16, H, generator=g)
    opt = torch.optim.SGD([layer.router], lr=0.02)

    def busiest():
        layer(x)
        r = layer.last_routing
        return (r.tokens_per_expert.max() / r.tokens_per_expert.sum()).item(), r.aux_loss.item()

    before, aux_before = busiest()
    for _ in range(200):
        opt.zero_grad()
        (layer(x).sum() * 0).backward()  # the output's gradient 0: the router learns from the aux loss alone
        opt.step()
    after, aux_after = busiest()
    # every token starts with expert 0 among its two (share 1/2); balanced is 1/8 each, aux's minimum 1
    assert before == 0.5 and after < 0.2 and aux_before > 2.0 and aux_after < 1.01, (before, after, aux_after)


@pytest.mark.parametrize("kw,ep,words", [
    (dict(num_experts=6), 4, "model.moe.num_experts=6 does not split over parallel.ep=4"),
    (dict(top_k=9), 1, "model.moe.top_k=9 must be between 1 and num_experts=8"),
    (dict(score="relu"), 1, "model.moe.score='relu' must be one of softmax, sigmoid"),
    (dict(capacity_factor=0.0), 1, "model.moe.capacity_factor=0.0 must be > 0"),
])
def test_bad_settings_name_the_key(kw, ep, words):
    with pytest.raises(MoESpecError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _spec(**kw).check(ep)


def test_capacity_per_sequence():
    assert _spec(capacity_factor=1.0).capacity(8) == 2 and _spec(capacity_factor=1.25).capacity(8) == math.ceil(2.5)
    assert _spec().capacity(8) is None


def _skewed_worker(seed):
    """Every token prefers experts 0 and 1 (on ep rank 0): ep rank 1 receives no rows at all."""
    import torch.distributed as dist

    spec = _spec(capacity_factor=None)
    P, r = dist.get_world_size(), dist.get_rank()
    x, g = _inputs(seed)
    layer = MoELayer(spec, H, world_group(), "layers.0.mlp", seed=3, aux_scale=None)
    with torch.no_grad():
        layer.router[0] += 40.0 * x.mean((0, 1)) / x.mean((0, 1)).norm()
        layer.router[1] += 30.0 * x.mean((0, 1)) / x.mean((0, 1)).norm()
    xs = (x[:, r * B // P:(r + 1) * B // P] + 4 * x.mean((0, 1))).clone().requires_grad_()
    out = layer(xs)
    (out * g[:, r * B // P:(r + 1) * B // P]).mean().backward()
    tokens = layer.last_routing.tokens_per_expert
    return tokens, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_an_ep_rank_that_receives_no_rows():
    ranks = run_ranks(_skewed_worker, 2, 0, timeout=120)
    _check_no_rows(ranks)


def _check_no_rows(ranks):
    total = sum(t for t, _ in ranks)
    assert total[4:].sum() == 0 and total[:2].sum() > 0  # experts 4-7 (ep rank 1) got nothing
    for _, grads in ranks:
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert torch.count_nonzero(ranks[1][1]["experts.gate"]) == 0  # its experts: zero gradient, no hang


def _skewed_tp_worker(seed):
    """`_skewed_worker` at ep 2 x expert tp 2: the TP pair of ep rank 1 holds experts 4-7, split over it,
    and receives no rows (the expert TP all-reduces then move nothing and must not hang)."""
    from megazero.core.topology import Topology
    from megazero.runtime.parallel_context import ParallelContext

    pctx = ParallelContext(Topology(dp=2, tp=2), ep=2)
    spec = _spec(capacity_factor=None)
    x, g = _inputs(seed)
    layer = MoELayer(spec, H, pctx.ep_group, "layers.0.mlp", seed=3, expert_tp_group=pctx.tp_group, bias=True)
    with torch.no_grad():
        layer.router[0] += 40.0 * x.mean((0, 1)) / x.mean((0, 1)).norm()
        layer.router[1] += 30.0 * x.mean((0, 1)) / x.mean((0, 1)).norm()
    d = pctx.dp_rank
    xs = (x[:, d * B // 2:(d + 1) * B // 2] + 4 * x.mean((0, 1))).clone().requires_grad_()
    out = layer(xs)
    (out * g[:, d * B // 2:(d + 1) * B // 2]).mean().backward()
    return layer.last_routing.tokens_per_expert, {n: p.grad.clone() for n, p in layer.named_parameters()}


def test_an_ep_rank_that_receives_no_rows_with_expert_tensor_parallelism():
    ranks = run_ranks(_skewed_tp_worker, 4, 0, timeout=120)  # ranks (dp 0: tp 0, 1), (dp 1: tp 0, 1)
    assert all(torch.count_nonzero(grads["experts.gate"]) == 0 for _, grads in ranks[2:])
    assert all(torch.count_nonzero(grads["experts.gate"]) > 0 for _, grads in ranks[:2])
    assert all(torch.isfinite(g).all() for _, grads in ranks for g in grads.values())


def test_model_flops_count_what_a_token_runs():
    """MFU's model FLOPs: a dense 4h GeLU MLP gives Megatron's formula exactly; an MoE layer counts
    2 FLOPs per active parameter (router, top_k routed experts, shared experts), not every expert."""
    from megazero.core.flops import block_forward, model_flops_per_step
    from megazero.core.spec import load_spec

    gpt = load_spec("model_specs/gpt.py:debug")
    b, s, l, h, v = 8, gpt.seq_len, gpt.layers, gpt.hidden, gpt.vocab
    megatron = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    # float64 arithmetic on integers below 2^53: only the formula's divisions round (~1e-16 each)
    assert model_flops_per_step(gpt, b) == pytest.approx(megatron, rel=1e-12)
    for flavor in ("debug-moe", "debug-deepseek", "mixtral-8x7b"):
        spec = load_spec(f"model_specs/llama.py:{flavor}")
        moe = spec.moe
        layer = MoELayer(moe, spec.hidden, single_rank_group("ep"), "layers.0.mlp", seed=0, device="meta")
        per_expert = sum(p[0].numel() for p in layer.experts.parameters())
        active = layer.router.numel() + moe.top_k * per_expert + sum(p.numel() for p in (layer.shared or nn.Module()).parameters())
        assert block_forward(spec).mlp == 2 * active, flavor


def _expert_tp_worker(spec_kw, ep, bias, seed):
    """Rank (dp d, tp t) of ep × tp ranks (dp = ep): sequences d·B/ep .. of the batch, experts d·E/ep ..
    with their ffn split over the TP group; returns what the test compares."""
    import torch.distributed as dist

    from megazero.core.topology import Topology
    from megazero.moe.experts import gather_expert_tensors
    from megazero.runtime.parallel_context import ParallelContext
    from megazero.tensor_parallel import gather_full_grads

    tp = dist.get_world_size() // ep
    pctx = ParallelContext(Topology(dp=ep, tp=tp), ep=ep)
    spec = _spec(**spec_kw)
    layer = MoELayer(spec, H, pctx.ep_group, "layers.3.mlp", seed=11, aux_scale=lambda: 1.0 / ep,
                     expert_tp_group=pctx.tp_group, bias=bias)
    _set_biases(layer)
    x, g = _inputs(seed)
    d = pctx.dp_rank
    mine = slice(d * B // ep, (d + 1) * B // ep)
    xs = x[:, mine].clone().requires_grad_()
    out = layer(xs)
    ((out * g[:, mine]).mean() / ep).backward()
    shapes = {p.logical_name: (tuple(p.shape), p.tp_dim) for p in layer.parameters()}
    grads = gather_expert_tensors(gather_full_grads(layer, pctx.tp_group), layer, pctx.ep_group)
    return {"out": out.detach(), "x_grad": xs.grad, "grads": grads, "dp": d, "tp": pctx.tp_rank, "shapes": shapes}


@pytest.mark.parametrize("world,ep,kw,bias", [
    (2, 1, dict(shared_experts=1, shared_ffn=8), True),
    (4, 2, dict(capacity_factor=1.0, activation="gelu", score="sigmoid", shared_experts=1, shared_ffn=8), True),
    (4, 2, dict(), False),
])
def test_expert_tensor_parallel_equals_one_process(world, ep, kw, bias):
    """Experts' ffn split over tp = world / ep ranks (gate / up / fc1 column-parallel, down / fc2
    row-parallel, the output bias once after the all-reduce), experts over ep: outputs, the input's
    gradient and every parameter's gradient (whole: gathered over TP, then over ep; router and shared
    experts summed over the ep ranks' tokens) equal one process; the router's gradient is the same on
    every TP rank (the experts' outputs are whole before they are weighted)."""
    tp = world // ep
    spec = _spec(**kw)
    x, g = _inputs(5)
    serial = MoELayer(spec, H, single_rank_group("ep"), "layers.3.mlp", seed=11, bias=bias)
    _set_biases(serial)
    xs = x.clone().requires_grad_()
    (serial(xs) * g).mean().backward()
    out_ref = serial(x).detach()
    want = {p.logical_name: p.grad for p in serial.parameters()}
    ranks = run_ranks(_expert_tp_worker, world, kw, ep, bias, 5, timeout=120)
    by_dp = {rk["dp"]: rk for rk in ranks if rk["tp"] == 0}
    # fp32 as in test_expert_parallel_equals_one_process (TP adds an all-reduce: another summation order)
    torch.testing.assert_close(torch.cat([by_dp[d]["out"] for d in range(ep)], 1), out_ref, rtol=1e-5, atol=1e-6)
    # atol 1e-8: the input's gradient of a mean over all outputs is ~1e-2 of the outputs' size per entry
    torch.testing.assert_close(torch.cat([by_dp[d]["x_grad"] for d in range(ep)], 1), xs.grad, rtol=1e-5, atol=1e-8)
    for rk in ranks:  # every TP rank the same outputs and gradients as its TP rank 0
        twin = by_dp[rk["dp"]]
        assert torch.equal(rk["out"], twin["out"]) and torch.equal(rk["x_grad"], twin["x_grad"])
        assert torch.equal(rk["grads"]["layers.3.mlp.router"], twin["grads"]["layers.3.mlp.router"])
    f = spec.ffn
    shapes = ranks[0]["shapes"]
    assert shapes["layers.3.mlp.experts." + ("gate" if spec.activation == "swiglu" else "fc1")] == (
        (spec.num_experts // ep, f // tp, H), 1)
    assert shapes["layers.3.mlp.experts." + ("down" if spec.activation == "swiglu" else "fc2")] == (
        (spec.num_experts // ep, H, f // tp), 2)
    for name, grad in want.items():
        if ".experts." in name:  # whole already (every ep rank's slice, every token's gradient)
            got = by_dp[0]["grads"][name]
        else:  # router and shared experts: each ep rank's tokens' share, summed (what dp's reduction does)
            got = sum(by_dp[d]["grads"][name] for d in range(ep))
        # fp32, summed over ranks in another order: ~80 ulps relative; atol 1e-7 for the small entries of gradients of a mean
        torch.testing.assert_close(got, grad, rtol=1e-5, atol=1e-7, msg=name)
    assert bias == any(n.endswith("_bias") for n in want)


def _replay_worker(perturb: bool, record: bool, seed: int = 3):
    """One MoE layer (ep over every rank) trained one micro-batch with its forward checkpointed; with
    `perturb` the recompute's router logits are changed so that another top-k wins on every token (a
    non-chosen expert's logit raised above the best: the chosen experts' renormalised weights do not
    change), with `record` the layer gets the checkpointer's decisions. Returns (out, gradients, the
    experts the recompute's logits pick)."""
    import torch.distributed as dist

    from megazero.activation_checkpoint import ActivationCheckpointer, CheckpointOptions
    from megazero.moe.routing import decide

    P = dist.get_world_size() if dist.is_initialized() else 1
    r = dist.get_rank() if dist.is_initialized() else 0
    group = world_group() if P > 1 else single_rank_group("ep")
    spec = _spec(aux_loss_coef=0.0, z_loss_coef=0.0, capacity_factor=1.0)
    ckpt = ActivationCheckpointer(CheckpointOptions(policy="full"), single_rank_group("tp"))
    layer = MoELayer(spec, H, group, "layers.0.mlp", seed=seed, aux_scale=lambda: 1.0 / P,
                     decisions=ckpt.decisions if record else None)
    x, g = _inputs(seed)
    mine = slice(r * B // P, (r + 1) * B // P)
    real, picked = layer.router_logits, []

    def logits_fn(tokens):
        logits = real(tokens)
        if perturb and ckpt.decisions.replaying:  # the recompute: raise each token's worst expert above its best
            lo, hi = logits.detach().min(-1), logits.detach().max(-1).values
            bump = torch.zeros_like(logits).scatter(1, lo.indices.unsqueeze(1), (hi - lo.values + 1.0).unsqueeze(1))
            logits = logits + bump
            picked.append(decide(logits, S, spec).indices)
        return logits

    layer.router_logits = logits_fn
    xs = x[:, mine].clone().requires_grad_()
    out = ckpt.checkpoint(layer, xs, modules=[layer])
    ((out * g[:, mine]).mean() / P).backward()
    assert ckpt.stats.recomputes == 1
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": xs.grad}
    return out.detach(), grads, picked, layer.last_routing.indices


@pytest.mark.parametrize("P", [1, 2])
def test_recompute_replays_the_forwards_routing(P):
    """Under activation recompute the replayed forward reuses the forward's routing decision (experts,
    kept assignments, split sizes): with the recompute's logits perturbed so that every token picks
    another expert, the gradients still equal a run without perturbation, the weights being recomputed
    from the replayed logits at the saved experts. Without the record (the layer not given the
    checkpointer's decisions) the same perturbation changes the recompute (here: an error or other
    gradients); at ep = 2 it would change the all-to-all splits between ranks."""
    def run(*args):
        return run_ranks(_replay_worker, P, *args, timeout=120) if P > 1 else [_replay_worker(*args)]

    plain, replayed = run(False, True), run(True, True)
    for (out_a, grads_a, _, chose), (out_b, grads_b, picked, replayed_choice) in zip(plain, replayed, strict=True):
        # zero tolerance: the replay reuses the forward's routing, so the forward is the same computation bit for bit
        torch.testing.assert_close(out_b, out_a, rtol=0, atol=0)
        assert torch.equal(replayed_choice, chose) and len(picked) == 1
        assert (picked[0] != chose).any(dim=-1).all()  # the recompute's logits pick other experts for every token
        for name in grads_a:
            # the backward recomputes the expert MLPs in another order of operations (recompute): fp32, ~80 ulps relative, atol 1e-7 for small gradient entries
            torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)
    if P == 1:  # the control: the perturbation does change the recompute when nothing is replayed
        grads = plain[0][1]
        try:
            fresh = _replay_worker(True, False)[1]
        except RuntimeError as err:  # here: the recomputed rows no longer match the forward's graph
            assert "shape" in str(err) or "recompute" in str(err), err
            return
        # the same fp32 tolerance as above, so a difference it detects is not rounding: another expert choice moves gradients by O(1) relative
        assert any(not torch.allclose(fresh[n], grads[n], rtol=1e-5, atol=1e-7) for n in grads)
