"""Activation checkpointing: every policy gives the no-checkpointing run's losses and gradients.

Parity (fp32, CPU, gloo, dropout 0.1 on the hidden states and the attention probabilities): for each
policy (full per layer, every 2 layers, number_checkpoints, selective, partitioned, partitioned on the
host, contiguous), one step's loss and every parameter's reduced gradient equal those of policy
none in the same layout within 1e-6 relative (per tensor: max|g − g_ref| <= 1e-6 · max|g_ref|).
Layouts: pp=2 × tp=2 (with and without sequence parallelism), pp=2 × tp=2 × dp=2 with ZeRO-1,
ZeRO-3 (parameters regathered during the recompute), the zero-bubble and interleaved schedules.
The recompute replays the dropout masks, so in practice the numbers are bit-identical.

Also: the RNG snapshot replays tracker, CPU and injected-mask streams and restores the current ones;
segments and in-flight counts; the config keys' errors.
"""
import pytest
import torch

from tests.harness import run_ranks

RTOL = 1e-6

POLICIES = {
    "full": {"policy": "full"},
    "full-k2": {"policy": "full", "every_k_layers": 2},
    "full-n1": {"policy": "full", "number_checkpoints": 1, "synchronize_checkpoint_boundary": True},
    "selective": {"policy": "selective", "profile": True},
    "partitioned": {"policy": "full", "partition_activations": True},
    "partitioned-cpu": {"policy": "full", "partition_activations": True, "cpu_checkpointing": True},
    "partitioned-cpu-contiguous": {"policy": "full", "partition_activations": True, "cpu_checkpointing": True,
                                   "contiguous_memory_optimization": True, "number_checkpoints": 2},
    "contiguous": {"policy": "full", "contiguous_memory_optimization": True, "number_checkpoints": 2},
}
SP_POLICIES = ("full", "full-k2", "selective", "contiguous")


def config(pp=2, tp=2, dp=1, stage=0, sp=False, schedule="1f1b", chunks=1, layers=4, gas=4, ac=None):
    return {"model": {"spec": "model_specs/gpt.py:debug", "layers": layers, "dropout": 0.1,
                      "overrides": {"attention_dropout": 0.1}},
            "parallel": {"pp": pp, "tp": tp, "dp": dp, "sequence_parallel": sp},
            "pipeline": {"schedule": schedule, "chunks": chunks},
            "train": {"micro_batch_size": 2, "global_batch_size": 2 * gas * dp, "seed": 7},
            "optimizer": {"type": "sgd", "lr": 1.0}, "zero": {"stage": stage},
            "activation_checkpointing": ac or {"policy": "none"}}


def policy_worker(base: dict, names):
    """For policy none and each named policy: one step's loss and this rank's reduced gradients (by
    logical name, this TP shard), plus the checkpointer's counters."""
    import megazero

    out = {}
    for name in ("none",) + tuple(names):
        cfg = dict(base, activation_checkpointing=POLICIES.get(name, {"policy": "none"}))
        engine, optimizer, data, _ = megazero.initialize(config=cfg)
        captured = {}

        def capture():
            optimizer.reduce_grads()
            captured.update({p.logical_name: g.clone() for p, g in optimizer.reduced_gradients().items()})
            return {"skipped": False}
        optimizer.step = capture
        loss = engine.train_batch(data)
        ckpt = engine.module.activation_checkpointer
        out[name] = (loss, captured, ckpt.report() if ckpt is not None else None)
    return out


def assert_matches(results, names):
    for rank, per_policy in enumerate(results):
        ref_loss, ref_grads, _ = per_policy["none"]
        for name in names:
            loss, grads, report = per_policy[name]
            assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), (rank, name, loss, ref_loss)
            assert set(grads) == set(ref_grads), (rank, name)
            for key, g_ref in ref_grads.items():
                err = (grads[key] - g_ref).abs().max().item()
                assert err <= RTOL * g_ref.abs().max().item(), (rank, name, key, err)
            assert report["checkpoints"] > 0 and report["recomputes"] == report["checkpoints"], (name, report)


def test_every_policy_pp2_tp2():
    results = run_ranks(policy_worker, 4, config(), tuple(POLICIES), timeout=240)
    assert_matches(results, POLICIES)
    r = results[0]
    assert r["full-k2"][2]["segments"] == ["layers.0-1"] and r["full-n1"][2]["segments"] == ["layers.0-1"]
    assert r["full"][2]["segments"] == ["layers.0", "layers.1"]
    assert r["full-n1"][2]["synchronizations"] == 2 * r["full-n1"][2]["checkpoints"]  # forward + recompute
    assert r["selective"][2]["recompute_s"] > 0
    # partitioned: each rank keeps half of each layer input and all-gathers the other half back
    full, part = r["full"][2], r["partitioned"][2]
    assert part["kept_bytes"] * 2 == full["kept_bytes"] and part["gathered_bytes"] == part["kept_bytes"]
    # contiguous: 1 segment-slot per block x min(p - s, m) = 2 micro-batches in flight on stage 0
    assert r["contiguous"][2]["contiguous_slots"] == 2 * 2 and r["contiguous"][2]["contiguous_in_use"] == 0
    assert results[3]["contiguous"][2]["contiguous_slots"] == 2 * 1  # last stage: one micro-batch in flight


def test_every_policy_pp2_tp2_sequence_parallel():
    assert_matches(run_ranks(policy_worker, 4, config(sp=True), SP_POLICIES, timeout=240), SP_POLICIES)


def test_every_policy_pp2_tp2_dp2_zero1():
    assert_matches(run_ranks(policy_worker, 8, config(dp=2, stage=1, gas=2), tuple(POLICIES), timeout=300),
                   POLICIES)


@pytest.mark.parametrize("schedule, chunks, layers", [("zb-h1", 1, 4), ("interleaved", 2, 8), ("gpipe", 1, 4)])
def test_schedules(schedule, chunks, layers):
    names = ("full", "full-k2", "selective", "partitioned-cpu-contiguous")
    cfg = config(pp=2, tp=1, schedule=schedule, chunks=chunks, layers=layers)
    assert_matches(run_ranks(policy_worker, 2, cfg, names, timeout=240), names)


def zero3_worker(base: dict, names, steps: int = 2):
    """Per policy: losses of `steps` AdamW steps, the final full parameters (dp 0, tp 0) and the
    bytes all-gathered over dp."""
    import megazero
    from megazero.tensor_parallel import gather_full_params

    out = {}
    for name in ("none",) + tuple(names):
        cfg = dict(base, activation_checkpointing=POLICIES[name] if name != "none" else {"policy": "none"})
        engine, optimizer, data, _ = megazero.initialize(config=cfg)
        pctx = engine.pctx
        pctx.dp_group.stats.reset()
        losses = [engine.train_batch(data) for _ in range(steps)]
        gathered = pctx.dp_group.stats.total(axis=pctx.dp_group.axis, op="all_gather").bytes
        with optimizer.full_parameters():
            params = gather_full_params(engine.module, pctx.tp_group)
        out[name] = (losses, params if pctx.dp_rank == 0 else {}, gathered)
    return out


def test_zero3_regathers_parameters_in_recompute():
    names = ("full", "full-k2", "selective", "partitioned-cpu")
    base = dict(config(pp=1, tp=2, dp=2, stage=3, gas=2),
                optimizer={"type": "adamw", "lr": 1e-3}, gradient_clipping=1.0)
    results = run_ranks(zero3_worker, 4, base, names, timeout=240)
    for rank, per_policy in enumerate(results):
        ref_losses, ref_params, ref_gathered = per_policy["none"]
        for name in names:
            losses, params, gathered = per_policy[name]
            for a, b in zip(losses, ref_losses, strict=True):
                assert abs(a - b) <= RTOL * abs(b), (rank, name, losses, ref_losses)
            for key, p_ref in ref_params.items():
                assert (params[key] - p_ref).abs().max().item() <= RTOL * p_ref.abs().max().item(), (name, key)
            if name != "full-k2":  # one-block regions recompute while their block is gathered: no extra traffic
                assert gathered == ref_gathered, (rank, name, gathered, ref_gathered)


# -- single-process unit tests ---------------------------------------------------------------------

def _tiny(seed=0, p=0.5):
    """A small block with tracker dropout (replicated stream) and global-RNG noise."""
    from torch import nn

    from megazero.tensor_parallel import REPLICATED_STREAM, Dropout, RNGStatesTracker

    torch.manual_seed(seed)
    tracker = RNGStatesTracker(seed)
    mod = nn.Sequential(nn.Linear(8, 16), nn.GELU(), Dropout(p, tracker, REPLICATED_STREAM, "tiny.dropout"),
                        nn.Linear(16, 8))

    def fn(x):
        y = mod(x)
        return y + 0.1 * torch.rand_like(y)  # the global CPU generator, replayed too
    return mod, fn


def _checkpointer(**options):
    from megazero.activation_checkpoint import ActivationCheckpointer, CheckpointOptions
    from megazero.runtime.comm import single_rank_group

    return ActivationCheckpointer(CheckpointOptions(**({"policy": "full"} | options)), single_rank_group("tp"))


def _run_twice(fn, mod, wrap):
    """Two forward+backward passes (the second checks the streams were left where they belong)."""
    outs, grads = [], []
    for i in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
        y = wrap(fn, x)
        (y * y).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad] + [p.grad.clone() for p in mod.parameters()])
        mod.zero_grad()
    return outs, grads


@pytest.mark.parametrize("options", [{}, {"partition_activations": True, "cpu_checkpointing": True},
                                     {"contiguous_memory_optimization": True, "number_checkpoints": 1}])
def test_checkpoint_replays_dropout_and_global_rng_exactly(options):
    mod, fn = _tiny()
    ref = _run_twice(fn, mod, lambda f, x: f(x))
    mod, fn = _tiny()
    ckpt = _checkpointer(**options)
    got = _run_twice(fn, mod, lambda f, x: ckpt.checkpoint(f, x, modules=[mod]))
    for a, b in zip(ref[0] + sum(ref[1], []), got[0] + sum(got[1], []), strict=True):
        assert torch.equal(a, b)
    assert ckpt.stats.checkpoints == 2 and ckpt.stats.recomputes == 2


def test_injected_logical_masks_replay_and_other_mask_functions_are_refused():
    from megazero.tensor_parallel import LogicalMaskFn, set_dropout_mask_fn

    mod, fn = _tiny()
    set_dropout_mask_fn(mod, LogicalMaskFn(3, 0.5))
    ref = _run_twice(fn, mod, lambda f, x: f(x))
    mod, fn = _tiny()
    set_dropout_mask_fn(mod, LogicalMaskFn(3, 0.5))
    ckpt = _checkpointer()
    got = _run_twice(fn, mod, lambda f, x: ckpt.checkpoint(f, x, modules=[mod]))
    assert all(torch.equal(a, b) for a, b in zip(sum(ref[1], []), sum(got[1], []), strict=True))
    set_dropout_mask_fn(mod, lambda site, shape, shard: torch.ones(shape, dtype=torch.bool))
    with pytest.raises(ValueError, match="tiny.dropout: .*LogicalMaskFn"):
        ckpt.checkpoint(fn, torch.randn(4, 8, requires_grad=True), modules=[mod])


def test_no_grad_forward_is_not_checkpointed_and_mismatched_recompute_is_an_error():
    mod, fn = _tiny()
    ckpt = _checkpointer()
    with torch.no_grad():
        ckpt.checkpoint(fn, torch.randn(4, 8), modules=[mod])
    assert ckpt.stats.checkpoints == 0
    calls = []

    def unstable(x):  # a different number of saved tensors on the second run
        calls.append(1)
        return (x * x).exp() if len(calls) == 1 else x * 2
    y = ckpt.checkpoint(unstable, torch.randn(3, requires_grad=True))
    with pytest.raises(RuntimeError, match="recompute saved 0 tensors .* forward saved 3"):
        y.sum().backward()


class _ViewOfInner(torch.autograd.Function):
    """x @ w.T returned as a view of the 2-D product made in forward (as F.linear does for 3-D inputs
    inside the TP regions): the output has a grad_fn, its base none."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x.reshape(-1, x.shape[-1]).mm(w.t()).view(*x.shape[:-1], w.shape[0])  # (..., out)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g2 = g.reshape(-1, g.shape[-1])  # (rows, out)
        return g2.mm(w).view(x.shape), g2.t().mm(x.reshape(-1, x.shape[-1]))


def test_recomputed_tensors_are_freed_after_backward():
    """The recompute keeps only leaves and views of grad-requiring leaves with their graph; a custom
    Function's output viewing an inner tensor is detached. Kept with its graph, it closed a cycle through
    autograd nodes (the graph's saved variables hold the recompute's pack hook, whose list holds the
    tensor) that gc cannot collect: every recomputed tensor of the region leaked."""
    import gc
    import weakref

    torch.manual_seed(0)
    w = torch.randn(6, 8, requires_grad=True)
    ckpt, refs = _checkpointer(), []

    class Watch:  # an observer: sees every recomputed tensor
        def hold(self, t):
            refs.append(weakref.ref(t))

    ckpt.observers.append(Watch())
    x = torch.randn(2, 3, 8, requires_grad=True)
    y = ckpt.checkpoint(lambda x: _ViewOfInner.apply(x, w).pow(2), x)
    y.sum().backward()
    del y
    gc.collect()
    assert refs and ckpt.stats.recomputes == 1
    assert [r for r in refs if r() is not None and r() is not w] == []
    assert torch.allclose(w.grad, (2 * _ViewOfInner.apply(x, w).reshape(-1, 6)).t().mm(x.reshape(-1, 8)))


def test_transformer_blocks_in_segments_match_and_run_in_order():
    from megazero.runtime.comm import single_rank_group
    from megazero.models.lm import layer_builders
    from megazero.core.spec import load_spec

    spec = load_spec("model_specs/gpt.py:debug", {"layers": 3, "dropout": 0.2, "attention_dropout": 0.2})

    def grads(policy, **kw):
        ckpt = _checkpointer(policy=policy, **kw) if policy != "none" else None
        builders = layer_builders(spec, single_rank_group("tp"), seed=5,
                                  attention_core=ckpt.attention_core if ckpt else None)[1:-1]
        blocks = [ckpt.wrap_block(b()) if ckpt else b() for b in builders]
        if ckpt:
            ckpt.attach([blocks])
        x = torch.randn(spec.seq_len, 2, spec.hidden, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y = x
        for blk in blocks:
            y = blk(y)
        y.square().sum().backward()
        return [x.grad] + [p.grad for blk in blocks for p in blk.parameters()], ckpt, blocks

    ref, _, _ = grads("none")
    for policy, kw in [("full", {"every_k_layers": 2}), ("full", {"number_checkpoints": 2}), ("selective", {})]:
        got, ckpt, blocks = grads(policy, **kw)
        assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True)), (policy, kw)
    _, ckpt, blocks = grads("full", every_k_layers=3)
    assert ckpt.report()["segments"] == ["layers.0-2"]
    with pytest.raises(RuntimeError, match="layers.0-2: block 1 ran without the segment's first block"):
        blocks[1](torch.randn(spec.seq_len, 2, spec.hidden, requires_grad=True))


def test_segments_and_in_flight_micro_batches():
    from megazero.activation_checkpoint import segment_sizes
    from megazero.core.schedules import get_schedule
    from megazero.core.simulate import peaks

    assert segment_sizes(4, 1, None) == [1, 1, 1, 1] and segment_sizes(5, 2, None) == [2, 2, 1]
    assert segment_sizes(4, 1, 3) == [1, 2, 1] and segment_sizes(2, 1, 5) == [1, 1]
    for p, m in [(4, 6), (4, 2), (2, 1)]:
        for name in ("1f1b", "zb-h1"):
            programs = get_schedule(name, p, m)
            assert [peaks(prog)[0] for prog in programs] == [min(p - s, m) for s in range(p)], name
        assert [peaks(prog)[0] for prog in get_schedule("gpipe", p, m)] == [m] * p


def test_contiguous_pool_errors_name_the_key():
    from megazero.activation_checkpoint import ContiguousPool

    pool = ContiguousPool(2, host=False)
    pool.acquire(6, torch.float32, torch.device("cpu"))
    slot, view = pool.acquire(6, torch.float32, torch.device("cpu"))
    assert view.numel() == 6 and pool.nbytes == 48
    with pytest.raises(RuntimeError, match="number_checkpoints: all 2 slots"):
        pool.acquire(6, torch.float32, torch.device("cpu"))
    pool.release(slot)
    with pytest.raises(ValueError, match="contiguous_memory_optimization: a checkpoint of 5"):
        pool.acquire(5, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("overrides, message", [
    (["activation_checkpointing.policy=full", "activation_checkpointing.partition_activations=true",
      "parallel.sequence_parallel=true", "parallel.tp=2"], "partition_activations: with parallel.sequence_parallel"),
    (["activation_checkpointing.policy=full", "activation_checkpointing.every_k_layers=2",
      "activation_checkpointing.number_checkpoints=3"], "both choose the checkpointed segments"),
    (["activation_checkpointing.policy=selective", "activation_checkpointing.partition_activations=true"],
     "partition_activations: acts on checkpointed layer inputs"),
    (["activation_checkpointing.policy=selective", "activation_checkpointing.every_k_layers=2"],
     "has no effect with policy=selective"),
    (["activation_checkpointing.profile=true"], "profile: has no effect with activation_checkpointing.policy=none"),
])
def test_config_errors(overrides, message):
    from megazero.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, world_size=2)


def test_checkpointing_keys_are_supported():
    from megazero.core.config import assert_supported, load_config

    cfg = load_config(None, ["activation_checkpointing.policy=full", "parallel.tp=2",
                             "activation_checkpointing.partition_activations=true",
                             "activation_checkpointing.cpu_checkpointing=true",
                             "activation_checkpointing.contiguous_memory_optimization=true",
                             "activation_checkpointing.number_checkpoints=4",
                             "activation_checkpointing.synchronize_checkpoint_boundary=true",
                             "activation_checkpointing.profile=true"], world_size=2)
    assert_supported(cfg)


def prebuilt_worker():
    import megazero
    from megazero.core.config import ConfigError

    try:
        megazero.initialize(model=torch.nn.Linear(4, 4), config={"activation_checkpointing": {"policy": "full"}})
    except ConfigError as err:
        return str(err)
    return None


def test_a_prebuilt_model_cannot_silently_skip_checkpointing():
    message = run_ranks(prebuilt_worker, 1, timeout=60)[0]
    assert message is not None and message.startswith("activation_checkpointing.policy=full: the model was passed")
