"""Saved-activation bytes, measured with megazero.run.memory.SavedActivationMeter, against docs/reference.md.

Per layer (one micro-batch of the debug GPT: s=32, b=2, h=64, a=8, FFN 4h, dropout on the hidden
states and the attention probabilities, fp32 on CPU), for no recompute, TP, TP+SP, selective (with and
without SP), full, full + SP, full + partitioned, full + partitioned on the host.

How the measured bytes map onto Korthikanti et al.'s terms (16-bit activations, 1-byte masks):

* fp32 doubles every 16-bit term; megazero's Dropout saves a bool keep-mask (1 byte per element, via
  masked_fill), so the mask terms stay 1 byte: 2·sbh (hidden dropouts) and a·s²·b (attention) of the
  no-parallel 34·sbh + 5·as²b are masks, giving fp32 66·sbh + 9·as²b; under TP the attention mask is
  divided by t, under SP the hidden masks too.
* q, k, v are separate GEMMs on one input (counted once: unique storages); the batched matmuls save
  contiguous copies of q, kᵀ and v (s·b·h/t each), the context GEMM a copy of its input: the same
  sizes the formula counts. GeLU saves its input (the formula's "GeLU input"), fc2 the GeLU output.
* Beyond the formula: each LayerNorm saves its mean and rstd (fp32, s·b each: 16·s·b per layer, /t
  under SP), and on CPU the reference causal softmax saves its s×s bool mask (s² bytes; the fused
  GPU kernel computes it on the fly). Both are inside the measured number, each well under 1%.
* Sequence parallelism: as in Megatron, the column-parallel GEMMs keep only this rank's input shard
  (s/t, b, h) and all-gather it again in backward (`tensor_parallel.weight_grad.Regather`), so the
  attention and MLP inputs count sbh/t, as the formula assumes.

The tests assert measured == mapped formula + the extras above exactly, and |measured − formula| /
formula <= 5% for every row. Peak in-flight bytes per stage over a pipeline step
follow the schedule: min(p − s, m) micro-batches for 1F1B, m for GPipe.
"""
import pytest

from tests.harness import run_ranks

S, B, H, A = 32, 2, 64, 8
SBH, AS2B = S * B * H, A * S * S * B
LN_STATS = 16 * S * B  # two LayerNorms x (mean, rstd) x 4 bytes x s·b
CAUSAL_MASK = S * S  # the CPU reference softmax's bool mask

# rows: name -> (tp, sequence_parallel, activation_checkpointing section)
ROWS = {
    "none": (1, False, {"policy": "none"}),
    "tp": (2, False, {"policy": "none"}),
    "tp+sp": (2, True, {"policy": "none"}),
    "selective": (2, False, {"policy": "selective"}),
    "sp+selective": (2, True, {"policy": "selective"}),
    "full": (2, False, {"policy": "full"}),
    "full+sp": (2, True, {"policy": "full"}),
    "full+partitioned": (2, False, {"policy": "full", "partition_activations": True}),
    "full+partitioned+cpu": (2, False, {"policy": "full", "partition_activations": True, "cpu_checkpointing": True}),
}


def formula_16bit(name: str, t: int) -> tuple[float, float]:
    """docs/reference.md's bytes per layer (16-bit activations) and the 1-byte mask part of them."""
    attn = 5 * AS2B / t
    table = {
        "none": (34 * SBH + 5 * AS2B, 2 * SBH + AS2B),
        "tp": (SBH * (10 + 24 / t) + attn, 2 * SBH + AS2B / t),
        "tp+sp": ((34 * SBH + 5 * AS2B) / t, (2 * SBH + AS2B) / t),
        "selective": (SBH * (10 + 24 / t), 2 * SBH),
        "sp+selective": (34 * SBH / t, 2 * SBH / t),
        "full": (2 * SBH, 0),
        "full+sp": (2 * SBH / t, 0),
        "full+partitioned": (2 * SBH / t, 0),
        "full+partitioned+cpu": (2 * SBH / t, 0),
    }
    return table[name]


def formula_fp32(name: str, t: int) -> float:
    """The table scaled for fp32: 16-bit terms doubled, 1-byte masks kept."""
    total, masks = formula_16bit(name, t)
    return 2 * total - masks


def megazero_extras(name: str, t: int) -> float:
    """What megazero saves beyond the formula (see the module docstring)."""
    tp, sp, ac = ROWS[name]
    if ac["policy"] == "full":
        return 0
    extra = LN_STATS / (t if sp else 1)
    if ac["policy"] == "none":
        extra += CAUSAL_MASK
    return extra


def config(tp, sp, ac, pp=1, gas=1, layers=2, schedule="1f1b"):
    return {"model": {"spec": "model_specs/gpt.py:debug", "layers": layers, "dropout": 0.1,
                      "overrides": {"attention_dropout": 0.1}},
            "parallel": {"pp": pp, "tp": tp, "sequence_parallel": sp}, "pipeline": {"schedule": schedule},
            "train": {"micro_batch_size": B, "global_batch_size": B * gas, "seed": 3},
            "optimizer": {"type": "sgd", "lr": 0.1}, "activation_checkpointing": ac}


def layer_worker(names):
    """{row: (device bytes, host bytes) saved by layers.0, tp all-gather bytes of the step)}."""
    import megazero
    from megazero.run.memory import SavedActivationMeter

    out = {}
    for name in names:
        tp, sp, ac = ROWS[name]
        engine, _, data, _ = megazero.initialize(config=config(tp, sp, ac))
        engine.pctx.tp_group.stats.reset()
        meter = SavedActivationMeter(engine.module, checkpointer=engine.module.activation_checkpointer)
        with meter.measure():
            engine.train_batch(data)
        layer = meter.per_layer["layers.0"]
        out[name] = (layer["device"], layer["host"],
                     engine.pctx.tp_group.stats.total(axis=engine.pctx.tp_group.axis, op="all_gather").bytes)
    return out


@pytest.fixture(scope="module")
def measured():
    one = run_ranks(layer_worker, 1, ["none"], timeout=120)[0]
    two = run_ranks(layer_worker, 2, [n for n in ROWS if n != "none"], timeout=180)
    assert two[0] == two[1]  # both TP ranks save the same amounts
    return one | two[0]


@pytest.mark.parametrize("name", list(ROWS))
def test_layer_bytes_match_the_formula(measured, name):
    t = ROWS[name][0]
    device, host, _ = measured[name]
    saved = device + host
    expected = formula_fp32(name, t) + megazero_extras(name, t)
    assert saved == expected, (name, saved, expected)
    assert abs(saved - formula_fp32(name, t)) <= 0.05 * formula_fp32(name, t), name


def test_partitioned_is_a_tth_of_full_and_cpu_leaves_no_device_bytes(measured):
    full, part, cpu = measured["full"], measured["full+partitioned"], measured["full+partitioned+cpu"]
    assert full == (4 * SBH, 0, full[2]) and part[0] * 2 == full[0] and part[1] == 0
    assert cpu[0] == 0 and cpu[1] == part[0]  # on the host (tagged), none on the device
    # the recompute all-gathers each partitioned layer input over TP: (t-1)/t of 4·sbh per layer, 2 layers
    assert part[2] - full[2] == 2 * 4 * SBH / 2 and cpu[2] == part[2]


def peak_worker(ac, gas, schedule):
    """(this stage, its peak in-flight saved bytes over one step, saved bytes per micro-batch, peak
    bytes of recomputed tensors, whether the stage holds blocks)."""
    import megazero
    from megazero.run.memory import SavedActivationMeter

    engine, _, data, _ = megazero.initialize(config=config(1, False, ac, pp=4, gas=gas, layers=4,
                                                            schedule=schedule))
    engine.train_batch(data)  # warm-up: the contiguous buffer and RNG generators exist afterwards
    meter = SavedActivationMeter(engine.module, checkpointer=engine.module.activation_checkpointer)
    with meter.measure():
        engine.train_batch(data)
    per_mb = sum(sum(v.values()) for v in meter.per_layer.values()) / gas
    assert meter.peak["host"] == 0
    has_blocks = any(label.startswith("layers.") for label in meter.per_layer)
    return engine.pctx.pp_rank, meter.peak["device"], per_mb, meter.peak["recompute"], has_blocks


@pytest.mark.parametrize("schedule, gas", [("1f1b", 6), ("1f1b", 2), ("gpipe", 3)])
@pytest.mark.parametrize("policy", ["none", "full"])
def test_peak_in_flight_follows_the_schedule(policy, schedule, gas):
    """Kept-for-backward bytes peak at (micro-batches in flight) x (bytes per micro-batch); with full
    recompute the recompute working set is one layer's activations less its kept input (shared)."""
    results = run_ranks(peak_worker, 4, {"policy": policy}, gas, schedule, timeout=180)
    one_layer = formula_fp32("none", 1) + megazero_extras("none", 1)
    for stage, peak, per_mb, recompute, has_blocks in results:
        in_flight = min(4 - stage, gas) if schedule == "1f1b" else gas
        assert peak == in_flight * per_mb, (stage, peak, per_mb, in_flight)
        assert recompute == (one_layer - 4 * SBH if policy == "full" and has_blocks else 0), (stage, recompute)


def _live_bytes() -> int:
    """Bytes of the tensor storages Python can reach (each tensor object, and a leaf's ``.grad``), each
    storage once, after a gc pass: what `megazero.run.memory.LiveTensorBytes` seeds its count with."""
    import gc

    import torch

    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor):
            for t in (obj, obj.grad if obj.is_leaf else None):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def steady_worker(schedule, stage, steps=3):
    """Live tensor bytes at the start of each step, and after the last."""
    import megazero

    cfg = {"model": {"spec": "model_specs/gpt.py:debug", "layers": 4, "hidden": 32, "heads": 4, "vocab": 64,
                     "seq_len": 16},
           "parallel": {"pp": 2, "tp": 2}, "pipeline": {"schedule": schedule},
           "train": {"micro_batch_size": 2, "global_batch_size": 8, "seed": 5},
           "zero": {"stage": stage, "overlap_comm": False}, "activation_checkpointing": {"policy": "full"},
           "optimizer": {"type": "adamw", "lr": 1e-4}}
    engine, _, data, _ = megazero.initialize(config=cfg)
    live = []
    for _ in range(steps):
        live.append(_live_bytes())
        engine.train_batch(data)
    return live + [_live_bytes()]


@pytest.mark.parametrize("schedule, stage", [("zb-h1", 3), ("1f1b", 1)])
def test_full_recompute_leaves_nothing_alive_across_steps(schedule, stage):
    """After the first step (which creates gradients, optimizer states and buffers), a step ends with the
    tensors it started with. The recompute once kept a custom Function's output (a view of a tensor made
    in its forward, F.linear's 3-D result: no grad_fn on the base) with its graph, whose saved variables
    hold the recompute's pack hook and so the list of kept tensors: a cycle through autograd nodes that
    gc cannot collect, ~one layer's activations per micro-batch and block leaked every step."""
    for rank, live in enumerate(run_ranks(steady_worker, 4, schedule, stage, timeout=180)):
        assert live[1] == live[2] == live[3], (rank, live)
