"""The MoE MLP (megazero.moe) against an independent reference, and over expert-parallel ranks.

- `route` equals a loop over sequences, tokens and choices: top-k, weights, capacity (first choices
  first, earlier positions first, per sequence), the Switch aux loss and the z-loss;
- one process: `MoELayer` equals a token-by-token reference (each token's kept experts run one at a
  time and are summed with their weights), outputs and every gradient, aux and z losses included;
- ep = 2 and 4 ranks (gloo): each rank routes its own sequences and holds E/ep experts; outputs,
  losses and gradients (experts: their slice; router: summed over ranks) equal one process running
  all the sequences with all the experts, within 1e-5, with and without token dropping, softmax and
  sigmoid scores, GeLU and SwiGLU, with a shared expert;
- the all-to-all bytes the comm stats count equal the formula from the routing;
- the aux loss alone, trained on a router skewed towards one expert, spreads the load.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

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
    ex = layer.experts

    def expert(e, v):
        if layer.spec.activation == "swiglu":
            return ex.down[e] @ (F.silu(ex.gate[e] @ v) * (ex.up[e] @ v))
        return ex.fc2[e] @ F.gelu(ex.fc1[e] @ v)

    rows = []
    for t in range(b * s):
        acc = torch.zeros(h)
        for c in range(layer.spec.top_k):
            if keep[t, c]:
                acc = acc + w[t, c] * expert(int(idx[t, c]), tokens[t])
        if layer.shared is not None:
            sh = layer.shared
            acc = acc + (sh.down[0] @ (F.silu(sh.gate[0] @ tokens[t]) * (sh.up[0] @ tokens[t]))
                         if layer.spec.activation == "swiglu" else sh.fc2[0] @ F.gelu(sh.fc1[0] @ tokens[t]))
        rows.append(acc)
    out = torch.stack(rows).view(b, s, h).transpose(0, 1)
    return out, aux, z


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _grads(layer):
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


@pytest.mark.parametrize("activation,cf,shared,score", [("swiglu", None, 0, "softmax"), ("gelu", 1.0, 1, "softmax"),
                                                        ("swiglu", 1.0, 2, "sigmoid")])
def test_one_process_equals_token_by_token(activation, cf, shared, score):
    spec = _spec(activation=activation, capacity_factor=cf, shared_experts=shared, shared_ffn=6, score=score)
    x, g = _inputs()
    layer = MoELayer(spec, H, single_rank_group("ep"), "layers.0.mlp", seed=7)
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
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.last_routing.aux_loss, aux)
    for name in want:
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
    torch.testing.assert_close(torch.cat([rk["out"] for rk in ranks], 1), out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([rk["x_grad"] for rk in ranks], 1), xs.grad, rtol=1e-5, atol=1e-8)
    assert sum(rk["aux"] for rk in ranks) / P == pytest.approx(serial.last_routing.aux_loss.item(), rel=1e-6)
    assert sum(rk["z"] for rk in ranks) / P == pytest.approx(serial.last_routing.z_loss.item(), rel=1e-6)
    assert torch.equal(sum(rk["tokens"] for rk in ranks), serial.last_routing.tokens_per_expert)
    for name, grad in want.items():
        if name.startswith("experts."):  # each rank holds its slice of the experts, with every rank's tokens' gradient
            got = torch.cat([rk["grads"][name] for rk in ranks])
        else:  # router and shared expert: replicated, each rank's share summed (what dp's reduction does)
            got = sum(rk["grads"][name] for rk in ranks)
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
        layer(x)
        layer.last_routing.aux_loss.backward()
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
    total = sum(t for t, _ in ranks)
    assert total[4:].sum() == 0 and total[:2].sum() > 0  # experts 4-7 (ep rank 1) got nothing
    for _, grads in ranks:
        assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert torch.count_nonzero(ranks[1][1]["experts.gate"]) == 0  # its experts: zero gradient, no hang
