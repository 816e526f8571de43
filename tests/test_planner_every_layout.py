"""The planner answers for every layout the trainer accepts, and refuses only what the trainer refuses.

Hypothesis draws layouts of the debug models (GPT, Llama, MoE; 1-7 layers; 64 or 12 tokens) over 1-8 ranks: pp,
tp, cp (ring or Ulysses), dp, every
schedule (built-in and a .csv file), chunks, every ``pipeline.partition`` form, ZeRO 0-3 with offload, every
recompute policy with the activation-checkpointing options, sequence parallelism, precision, micro-batches,
the global batch, ep and expert TP, hierarchical collectives, ZeRO++ and 1-bit Adam. Each becomes the
``key=value`` overrides a user would give, and the trainer's own pre-launch check
(`megazero.engine.load_run_config`: config validation, the spec against the layout, the partition and the
schedule) decides whether it runs. Then:

* the trainer accepts it -> `layout_of` gives the planner's `Layout` with no problem, and the memory plan
  (per stage) and the step time (finite, positive) come out;
* the planner refuses the layout -> the trainer refuses it; where both ask one rule (the partition:
  core/spec_partition.py; activation checkpointing: core/checkpoint_rules.py; the schedule's sizes:
  core/schedules.py) the planner's message is in the trainer's, word for word. (The other rules, e.g. tp
  dividing the heads or the batch dividing micro-batch x dp, the planner words with its own argument names.)
"""
from __future__ import annotations

import math
import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from megazero.core.spec import SpecError
from megazero.engine import load_run_config
from megazero.planner.from_config import layout_of, spec_of
from megazero.planner.hardware import load_hardware
from megazero.planner.layout import Layout, PlanError
from megazero.planner.memory_plan import predict_memory
from megazero.planner.speed import predict_step

A100 = load_hardware("a100-80gb", "configs/hardware")
MODELS = {"gpt": "configs/debug_gpt.yaml", "llama": "configs/debug_llama.yaml", "moe": "configs/debug_moe.yaml"}
CSV = os.path.join(os.path.dirname(__file__), "data", "two_stage_1f1b.csv")


@st.composite
def layouts(draw):
    """(model config, the overrides, the planner's Layout of the same choices, world size)."""
    model = draw(st.sampled_from(sorted(MODELS)))
    world = draw(st.sampled_from([1, 2, 4, 8]))
    tp = draw(st.sampled_from([d for d in (1, 2, 4) if world % d == 0]))
    pp = draw(st.sampled_from([d for d in (1, 2, 4, 8) if world % (tp * d) == 0]))
    cp = draw(st.sampled_from([c for c in (1, 2, 4) if world % (tp * pp * c) == 0]))
    cp_method = draw(st.sampled_from(["ring", "ulysses"]))
    seq = draw(st.sampled_from([64, 64, 64, 12]))  # 12: not 2·cp chunks at cp 4, nor at cp 2 with tp 2 and SP
    dp = world // (tp * pp * cp)
    layers = draw(st.integers(1, 7))
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "interleaved", "zb-h1"] + (["csv"] if pp == 2 else [])))
    chunks = draw(st.integers(2, 3)) if schedule == "interleaved" else 1
    parts = pp * chunks
    cuts = sorted(draw(st.lists(st.integers(0, layers), min_size=parts - 1, max_size=parts - 1)))
    split = tuple(b - a for a, b in zip([0] + cuts, cuts + [layers], strict=True))  # blocks per part, summing to the layers
    partition = draw(st.one_of(st.sampled_from(["uniform", "parameters", "flops", "type:Block", "type:Embed"]),
                               st.just(split),
                               st.lists(st.integers(0, 3), min_size=parts, max_size=parts).map(tuple)))
    mb = draw(st.integers(1, 2))
    micro_batches = draw(st.integers(1, 8))
    global_batch = mb * dp * micro_batches + draw(st.sampled_from([0, 0, 0, 1]))  # now and then not divisible
    zero = draw(st.integers(0, 3))
    recompute = draw(st.sampled_from(["none", "selective", "full"]))
    full = recompute == "full"
    every_k = draw(st.integers(1, 2)) if full else 1
    number = draw(st.sampled_from([None, 1, 2])) if full and every_k == 1 else None
    part_act = full and draw(st.booleans())
    cpu = part_act and draw(st.booleans())
    contiguous = full and number is not None and draw(st.booleans())
    sp = tp > 1 and draw(st.booleans())
    offload_opt = zero > 0 and draw(st.booleans())
    offload_param = zero == 3 and offload_opt and draw(st.booleans())
    precision = draw(st.sampled_from(["fp32", "bf16"]))
    ep = draw(st.sampled_from([e for e in (1, 2) if dp % e == 0])) if model == "moe" else 1
    hierarchical = dp > 1 and draw(st.booleans())
    qwz = zero == 3 and draw(st.booleans())
    fields = dict(tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=global_batch, zero=zero, recompute=recompute,
                  schedule=CSV if schedule == "csv" else schedule, chunks=chunks, partition=partition,
                  every_k_layers=every_k, number_checkpoints=number, partition_activations=part_act,
                  cpu_checkpointing=cpu, contiguous_checkpoints=contiguous, sequence_parallel=sp,
                  offload_optimizer=offload_opt, offload_param=offload_param, precision=precision, ep=ep,
                  hierarchical=hierarchical, ranks_per_node=2 if hierarchical and world >= 4 else None,
                  quantized_weights=qwz, cp=cp, cp_method=cp_method)
    overrides = [f"model.layers={layers}", f"parallel.pp={pp}", f"parallel.tp={tp}",
                 f"parallel.sequence_parallel={str(sp).lower()}", f"train.micro_batch_size={mb}",
                 f"train.global_batch_size={global_batch}", f"zero.stage={zero}", f"precision={precision}",
                 f"pipeline.schedule={fields['schedule']}", f"pipeline.chunks={chunks}",
                 "pipeline.partition=" + (partition if isinstance(partition, str) else str(list(partition))),
                 f"activation_checkpointing.policy={recompute}", f"activation_checkpointing.every_k_layers={every_k}",
                 f"activation_checkpointing.number_checkpoints={'null' if number is None else number}",
                 f"activation_checkpointing.partition_activations={str(part_act).lower()}",
                 f"activation_checkpointing.cpu_checkpointing={str(cpu).lower()}",
                 f"activation_checkpointing.contiguous_memory_optimization={str(contiguous).lower()}",
                 f"zero.offload_optimizer.device={'cpu' if offload_opt else 'none'}",
                 f"zero.offload_param.device={'cpu' if offload_param else 'none'}",
                 f"comm.hierarchical={str(hierarchical).lower()}", f"zero.quantized_weights={str(qwz).lower()}",
                 f"parallel.cp={cp}", f"parallel.cp_method={cp_method}", f"model.seq_len={seq}", "data.path=null"]
    if fields["ranks_per_node"]:
        overrides.append(f"parallel.ranks_per_node={fields['ranks_per_node']}")
    if model == "moe":
        overrides.append(f"parallel.ep={ep}")
    return MODELS[model], overrides, fields, (layers, seq), world


def _trainer(config: str, overrides: list[str], world: int):
    """(the resolved Config, "") when the trainer's pre-launch check accepts the layout, else (None, why)."""
    try:
        return load_run_config(config, overrides, world_size=world), ""
    except (ValueError, SpecError) as err:  # ConfigError, ScheduleError, MoESpecError are ValueErrors
        return None, str(err)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(layouts())
def test_the_planner_plans_what_the_trainer_runs_and_refuses_what_it_refuses(drawn):
    config, overrides, fields, model_size, world = drawn
    cfg, why = _trainer(config, overrides, world)
    event("the trainer accepts" if cfg is not None else "the trainer refuses")
    event(f"cp {fields['cp']}, the trainer " + ("accepts" if cfg is not None else "refuses"))
    if cfg is not None:
        layout, reason = layout_of(cfg)
        assert layout is not None, reason
        spec = spec_of(cfg)
        assert layout.problems(spec) == [], (overrides, layout.problems(spec))
        memory = predict_memory(spec, layout, device="cpu", param_persistence_threshold=cfg.zero.param_persistence_threshold)
        step = predict_step(spec, layout, A100)
        assert len(memory.stages) == layout.pp and all(st.total > 0 for st in memory.stages)
        assert math.isfinite(step.step_time_s) and step.step_time_s > 0
        for name, value in fields.items():  # the planner plans the layout the overrides describe
            assert getattr(layout, name) == value, (name, getattr(layout, name), value)
        return
    # the trainer refuses; a planner refusal of a shared rule is in its words
    spec = _spec(config, *model_size)
    problems = Layout(**fields).problems(spec) if spec is not None else []
    shared = [p for p in problems if p.startswith(SHARED)]
    if shared and len(shared) == len(problems):  # the trainer stops at its first failing check
        assert any(p in why for p in shared), (overrides, problems, why)


SHARED = ("pipeline.partition", "activation_checkpointing", "the 'interleaved' schedule", "chunks=")


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(layouts())
def test_what_the_planner_refuses_the_trainer_refuses(drawn):
    config, overrides, fields, model_size, world = drawn
    spec = _spec(config, *model_size)
    if spec is None or not Layout(**fields).problems(spec):
        return
    cfg, why = _trainer(config, overrides, world)
    assert cfg is None, (overrides, Layout(**fields).problems(spec))


def _spec(config: str, layers: int, seq: int):
    from megazero.core.config import load_config

    try:
        return spec_of(load_config(config, [f"model.layers={layers}", f"model.seq_len={seq}", "data.path=null"]))
    except (ValueError, SpecError, PlanError):
        return None

