"""Tensor-parallel operators and layers on real gloo ranks, against single-process PyTorch.

One 4-rank run checks everything for two TP sizes at once: tp=4 (all ranks) and tp=2 (a dp=2 x tp=2
grid). Relative error of a tensor = max|a - b| / max|b|; fp32 tolerance 1e-5 (measured ~1e-7).
"""
import pytest
import torch
import torch.nn.functional as F

from megazero.runtime.parallel_context import ParallelContext
from megazero.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                      copy_to_tp_region, gather_from_sequence_parallel_region,
                                      gather_from_tp_region, gather_full_grads, gather_full_params,
                                      reduce_from_tp_region, reduce_scatter_to_sequence_parallel_region,
                                      scatter_to_sequence_parallel_region, scatter_to_tp_region,
                                      sync_sequence_parallel_grads, vocab_parallel_cross_entropy)
from megazero.core.topology import Topology
from tests.harness import run_ranks

TOL = 1e-5


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _check_mappings(g):
    """Forward and backward of every conjugate operator, with exact expected values and comm counts."""
    t, r = g.size, g.rank
    out = {}
    x = _randn(8, 3, 12, seed=1)  # the same on every rank
    gr = _randn(8, 3, 12, seed=10 + r)  # a different gradient on each rank
    all_gr = sum(_randn(8, 3, 12, seed=10 + k) for k in range(t))  # the sum of gr over the group

    a = x.clone().requires_grad_()
    y = copy_to_tp_region(a, g)
    y.backward(gr)
    out["f"] = torch.equal(y, x) and rel(a.grad, all_gr) < TOL

    a = gr.clone().requires_grad_()
    y = reduce_from_tp_region(a, g)
    y.backward(x)
    out["g"] = rel(y, all_gr) < TOL and torch.equal(a.grad, x)

    a = x.clone().requires_grad_()
    y = scatter_to_tp_region(a, g)
    y.backward(x.chunk(t, -1)[r] * 2)
    out["scatter"] = torch.equal(y, x.chunk(t, -1)[r]) and torch.equal(a.grad, x * 2)

    a = x.chunk(t, -1)[r].clone().requires_grad_()
    y = gather_from_tp_region(a, g)
    y.backward(x * 3)
    out["gather"] = torch.equal(y, x) and torch.equal(a.grad, (x * 3).chunk(t, -1)[r])

    a = x.clone().requires_grad_()
    y = scatter_to_sequence_parallel_region(a, g)
    y.backward(x.chunk(t, 0)[r] * 2)
    out["sp_scatter"] = torch.equal(y, x.chunk(t, 0)[r]) and torch.equal(a.grad, x * 2)

    a = x.chunk(t, 0)[r].clone().requires_grad_()
    y = gather_from_sequence_parallel_region(a, g)
    y.backward(gr)  # partial gradients: reduce-scattered
    out["sp_gather"] = torch.equal(y, x) and rel(a.grad, all_gr.chunk(t, 0)[r]) < TOL

    a = gr.clone().requires_grad_()
    y = reduce_scatter_to_sequence_parallel_region(a, g)
    y.backward(x.chunk(t, 0)[r])
    out["sp_reduce_scatter"] = rel(y, all_gr.chunk(t, 0)[r]) < TOL and torch.equal(a.grad, x)
    return out


def _check_linear_layers(g):
    """Column/Row parallel linear (all modes) against F.linear with the gathered full weights."""
    t, r = g.size, g.rank
    out = {}
    x, gy = _randn(8, 2, 12, seed=2), _randn(8, 2, 20, seed=3)  # (s, b, in), (s, b, out)
    for gather_output, sp in [(False, False), (True, False), (False, True)]:
        layer = ColumnParallelLinear(12, 20, g, gather_output=gather_output, sequence_parallel=sp, name="c", seed=5)
        w = gather_full_params(layer, g)
        a = (x.chunk(t, 0)[r] if sp else x).clone().requires_grad_()
        y = layer(a)
        y.backward(gy if gather_output else gy.chunk(t, -1)[r])
        xr = x.clone().requires_grad_()
        yr = F.linear(xr, w["c.weight"], w["c.bias"])
        yr.backward(gy)
        grads = gather_full_grads(layer, g)
        errs = [rel(y, yr if gather_output else yr.chunk(t, -1)[r]),
                rel(a.grad, xr.grad.chunk(t, 0)[r] if sp else xr.grad)]
        errs += [rel(grads["c.weight"], _lin_wgrad(x, gy)),
                 rel(grads["c.bias"], gy.sum((0, 1)))]
        out[f"column gather={gather_output} sp={sp}"] = max(errs)
    for parallel_in, sp in [(False, False), (True, False), (True, True)]:
        layer = RowParallelLinear(20, 12, g, input_is_parallel=parallel_in, sequence_parallel=sp, name="r", seed=6)
        w = gather_full_params(layer, g)
        xin, gout = _randn(8, 2, 20, seed=4), _randn(8, 2, 12, seed=5)
        a = (xin.chunk(t, -1)[r] if parallel_in else xin).clone().requires_grad_()
        y = layer(a)
        y.backward(gout.chunk(t, 0)[r] if sp else gout)
        xr = xin.clone().requires_grad_()
        yr = F.linear(xr, w["r.weight"], w["r.bias"])
        yr.backward(gout)
        grads = gather_full_grads(layer, g)
        bias_grad = grads["r.bias"].clone()
        if sp:  # sequence-parallel bias gradient is a partial sum: reduce it as the engine would
            sync_sequence_parallel_grads(layer, g)
            bias_grad = layer.bias.grad
        errs = [rel(y, yr.chunk(t, 0)[r] if sp else yr),
                rel(a.grad, xr.grad.chunk(t, -1)[r] if parallel_in else xr.grad),
                rel(grads["r.weight"], _lin_wgrad(xin, gout)), rel(bias_grad, gout.sum((0, 1)))]
        out[f"row parallel_in={parallel_in} sp={sp}"] = max(errs)
    return out


def _lin_wgrad(x, gy):
    return gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def _check_embedding_and_ce(g):
    """Vocab-parallel embedding and cross-entropy with a vocabulary (1001) not divisible by tp."""
    t, r = g.size, g.rank
    out = {}
    V = 1001
    emb = VocabParallelEmbedding(V, 16, g, vocab_align=1, name="e", seed=7)
    out["padded_rows"] = emb.weight.shape[0] * t - V
    ids = torch.randint(0, V, (8, 3), generator=torch.Generator().manual_seed(8))
    ids[0, 0], ids[1, 1] = 0, V - 1
    full = gather_full_params(emb, g)["e.weight"]
    y = emb(ids)
    gy = _randn(8, 3, 16, seed=9)
    y.backward(gy)
    ref_w = full.clone().requires_grad_()
    F.embedding(ids, ref_w).backward(gy)
    out["embedding"] = max(rel(y, F.embedding(ids, full)), rel(gather_full_grads(emb, g)["e.weight"], ref_w.grad))
    logits = _randn(6, 4, V, seed=11) * 3
    labels = torch.randint(0, V, (6, 4), generator=torch.Generator().manual_seed(12))
    labels[0, :2] = -100
    labels[1, 0], labels[1, 1] = V - 1, 0
    per = -(-V // t)
    for smoothing in (0.0, 0.1):
        for reduction in ("none", "mean", "sum"):
            shard = F.pad(logits, (0, per * t - V)).chunk(t, -1)[r].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(shard, labels, g, V, label_smoothing=smoothing, reduction=reduction)
            ref_in = logits.clone().requires_grad_()
            ref = F.cross_entropy(ref_in.reshape(-1, V), labels.reshape(-1), label_smoothing=smoothing,
                                  reduction=reduction)
            ref = ref.reshape(6, 4) if reduction == "none" else ref
            gl = _randn(6, 4, seed=13) if reduction == "none" else torch.tensor(1.7)
            loss.backward(gl)
            ref.backward(gl)
            ref_grad = F.pad(ref_in.grad, (0, per * t - V)).chunk(t, -1)[r]
            out[f"ce smoothing={smoothing} {reduction}"] = max(rel(loss, ref), rel(shard.grad, ref_grad))
    return out


def _layers_worker():
    results = {}
    for topo in (Topology(tp=4), Topology(dp=2, tp=2)):
        pctx = ParallelContext(topo)
        g = pctx.tp_group
        res = {"mappings": _check_mappings(g)}
        pctx.stats.reset()
        gather_from_sequence_parallel_region(torch.ones(4, 3), g)
        res["ag_elements"] = pctx.stats.total("tp", "all_gather").elements
        res.update(linear=_check_linear_layers(g), emb=_check_embedding_and_ce(g))
        results[g.size] = res
    return results


@pytest.fixture(scope="module")
def layer_results():
    return run_ranks(_layers_worker, 4, timeout=60)


@pytest.mark.parametrize("t", [2, 4])
def test_conjugate_operators_forward_and_backward(layer_results, t):
    for rank_res in layer_results:
        res = rank_res[t]
        assert all(res["mappings"].values()), res["mappings"]
        assert res["ag_elements"] == (t - 1) * 12  # all-gather of a (4, 3) shard: (t-1)·numel(shard)


@pytest.mark.parametrize("t", [2, 4])
def test_column_and_row_parallel_linear_match_dense(layer_results, t):
    for rank_res in layer_results:
        errs = rank_res[t]["linear"]
        assert max(errs.values()) < TOL, errs


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy_with_padding(layer_results, t):
    for rank_res in layer_results:
        res = rank_res[t]["emb"]
        assert res.pop("padded_rows") == -(-1001 // t) * t - 1001
        assert max(res.values()) < TOL, res


def test_cross_entropy_rejects_bad_arguments():
    from megazero.runtime.comm import single_rank_group
    g = single_rank_group("tp")
    with pytest.raises(ValueError, match="labels shape"):
        vocab_parallel_cross_entropy(torch.zeros(3, 10), torch.zeros(4, dtype=torch.long), g, 10)
    with pytest.raises(ValueError, match="vocab_size=12"):
        vocab_parallel_cross_entropy(torch.zeros(3, 10), torch.zeros(3, dtype=torch.long), g, 12)
    with pytest.raises(ValueError, match="label_smoothing"):
        vocab_parallel_cross_entropy(torch.zeros(3, 10), torch.zeros(3, dtype=torch.long), g, 10, label_smoothing=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_vocab_parallel_cross_entropy_peak_bytes_are_its_formula(dtype, smoothing):
    """At b·s·V = 0.8G logits the old forward held three fp32 copies and saved a fourth (about 10 GB);
    now one fp32 (tokens, V) buffer is made, saved as the softmax and turned into the gradient in
    place: peak 4 bytes per logit (+ the gradient's copy in a 16-bit dtype), on meta tensors of a
    realistic size, counted by the dry run's live-bytes meter."""
    from megazero.toolbox.dry_run import LiveBytes
    from megazero.runtime.comm import single_rank_group
    from megazero.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    tokens, vocab = 8192, 50304  # one 8k-token micro-batch of a GPT-2 vocabulary (padded)
    logits = torch.empty(tokens, vocab, dtype=dtype, device="meta", requires_grad=True)
    labels = torch.empty(tokens, dtype=torch.long, device="meta")
    with LiveBytes() as meter:
        logits[:1]  # the meter counts the logits' own storage from here on, whatever the function does first
        loss = vocab_parallel_cross_entropy(logits, labels, single_rank_group("tp"), 50257, smoothing)
        forward = meter.peak
        loss.sum().backward()
    per_logit = tokens * vocab
    # the meter also counts the logits' own storage (it meets it through the view above)
    small = per_logit * logits.element_size() + 64 * tokens * 4  # + per-token vectors (max, sums, masks)
    assert forward <= 4 * per_logit + small, forward / per_logit
    grad_copy = 0 if dtype == torch.float32 else 2 * per_logit
    assert meter.peak <= 4 * per_logit + grad_copy + small, meter.peak / per_logit


def _reduce_in_place():
    from megazero.tensor_parallel.mappings import reduce_from_tp_region

    pctx = ParallelContext(Topology(tp=2))
    w = torch.nn.Parameter(torch.full((3, 4), float(pctx.tp_rank + 1)))
    x = torch.ones(2, 4)
    partial = x @ w.t()  # (2, 3): what a row-parallel GEMM gives each rank
    out = reduce_from_tp_region(partial, pctx.tp_group)
    same = out.data_ptr() == partial.data_ptr()
    out.sum().backward()
    saved = torch.nn.Parameter(torch.ones(2, 3))
    refused = False
    try:
        y = torch.exp(saved)
        reduce_from_tp_region(y, pctx.tp_group).sum().backward()
    except RuntimeError:
        refused = True  # exp saves its output for backward: overwritten in place, autograd refuses
    return same, out.tolist(), w.grad.tolist(), refused


def test_row_parallel_all_reduce_is_in_place_and_guarded():
    """g (a row-parallel output's all-reduce) overwrites the GEMM output instead of cloning it: the
    same storage, the sum of the ranks' partials, the weights' gradient unchanged; a tensor that
    backward needs (exp's output) is refused loudly by autograd, never silently corrupted."""
    for same, out, grad, refused in run_ranks(_reduce_in_place, 2, timeout=60):
        assert same
        assert out == [[12.0] * 3] * 2  # 4·1 + 4·2
        assert grad == [[2.0] * 4] * 3
        assert refused
