"""Published runs the planner is judged on and never fitted to (issue 33): each point names its source, the
layout as published (what is not published is stated as assumed), and the published figure the prediction is
compared with. `DEFAULT_EFFICIENCY` stays fitted on Megatron-LM's Table-1 rows up to 39.1B only
(`published.CALIBRATION`); these are validation points. Pure: no torch.

Metrics: ``hardware_tflops`` (TFLOP/s per GPU counting the recompute forward, as Megatron-LM and
Megatron-DeepSpeed report), ``step_s`` (seconds per iteration), ``mfu`` (model FLOPs utilization) and, where
published, ``memory_gb`` (the most a GPU held).
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.core.spec import ModelSpec, load_spec
from megazero.planner.layout import Layout
from megazero.planner.machine import MEGATRON_SC21, MEGAZERO, Implementation


def _gpt(layers: int, hidden: int, heads: int, dropout: float = 0.1) -> ModelSpec:
    """A GPT as Megatron-LM trained it in 2021-2022 (V = 51200, s = 2048, learned positions, tied head)."""
    return ModelSpec(family="gpt", layers=layers, hidden=hidden, heads=heads, vocab=51200, seq_len=2048,
                     norm="layernorm", activation="gelu_tanh", position="learned", tie_embeddings=True, bias=True,
                     dropout=dropout, attention_dropout=dropout, name=f"gpt-{layers}x{hidden}")


def _even(layers: int, stages: int) -> tuple[int, ...]:
    """Megatron's split: the blocks evenly over the virtual stages (embedding on the first, head on the last)."""
    return (layers // stages,) * stages


@dataclass(frozen=True)
class ValidationPoint:
    """One published run: `source`, the `spec` and `layout` it ran, the `hardware` preset, the published
    `metric` and `value`, `implementation` (Megatron-LM's 2021 block or megazero's), `assumed` (what the
    source does not state and the layout assumes) and, where published, `memory_gb`."""

    name: str
    source: str
    spec: ModelSpec
    layout: Layout
    hardware: str
    metric: str
    value: float
    implementation: Implementation = MEGATRON_SC21
    assumed: str = ""
    memory_gb: float | None = None


GPT3 = _gpt(96, 12288, 96)
MT530 = _gpt(105, 20480, 128)


def _zero3(spec: ModelSpec, gpus: int, batch: int, name: str, value: float) -> ValidationPoint:
    """Narayanan et al. 2021, Table 2: DeepSpeed ZeRO-3 without model parallelism inside Megatron-LM, full
    recompute, micro-batch = batch / GPUs (no accumulation)."""
    return ValidationPoint(
        name, "Narayanan et al. 2021, Table 2 (ZeRO-3)", spec,
        Layout(dp=gpus, micro_batch=batch // gpus, global_batch=batch, zero=3, recompute="full", precision="fp16",
               overlap_comm=True), "a100-80gb", "hardware_tflops", value, MEGAZERO,
        assumed="DeepSpeed's default buckets and prefetch")


def _ptdp(spec: ModelSpec, pp: int, gpus: int, batch: int, name: str, value: float) -> ValidationPoint:
    """Narayanan et al. 2021, Table 2: PTD-P (tp 8), micro-batch 1, full recompute."""
    return ValidationPoint(
        name, "Narayanan et al. 2021, Table 2 (PTD-P)", spec,
        Layout(tp=8, pp=pp, dp=gpus // (8 * pp), micro_batch=1, global_batch=batch, zero=0, recompute="full",
               partition=_even(spec.layers, pp), precision="fp16", overlap_comm=False, reduce_bucket_size=1 << 40),
        "a100-80gb", "hardware_tflops", value, assumed="1F1B (the schedule is not stated)")


def _korthikanti(spec: ModelSpec, pp: int, chunks: int, batch: int, micro: int, selective: bool, name: str,
                 value: float, dp: int = 1) -> ValidationPoint:
    """Korthikanti et al. 2022, Table 5 (and the 530B run at dp 8): tp 8, full recompute without sequence
    parallelism, or selective recompute with it; interleaved with 3 chunks for 175B and 530B."""
    return ValidationPoint(
        name, "Korthikanti et al. 2022, Table 5" if dp == 1 else "Korthikanti et al. 2022, Section 6.3", spec,
        Layout(tp=8, pp=pp, dp=dp, micro_batch=micro, global_batch=batch, zero=0,
               recompute="selective" if selective else "full", sequence_parallel=selective,
               schedule="interleaved" if chunks > 1 else "1f1b", chunks=chunks,
               partition=_even(spec.layers, pp * chunks), precision="fp16", overlap_comm=False,
               reduce_bucket_size=1 << 40),
        "a100-80gb", "step_s", value, assumed="")


def _mtnlg(gpus: int, value: float) -> ValidationPoint:
    """Smith et al. 2022 (MT-NLG 530B), Section 2.4: tp 8, pp 35, batch 1920, DeepSpeed's pipeline (1F1B)
    with ZeRO-1, full recompute."""
    dp = gpus // 280
    return ValidationPoint(
        f"MT-NLG 530B, {gpus} GPUs", "Smith et al. 2022, Section 2.4", load_spec("model_specs/gpt.py:mt-nlg-530b"),
        Layout(tp=8, pp=35, dp=dp, micro_batch=1, global_batch=1920, zero=1, recompute="full",
               partition=_even(105, 35), precision="bf16", overlap_comm=False),
        "a100-80gb", "step_s", value, assumed="micro-batch 1, ZeRO-1, V = 51200 (published 50272)")


def _llama3(dp: int, mfu: float) -> ValidationPoint:
    """The Llama 3 Herd of Models, Table 4: 405B at 8K context, tp 8, pp 16, interleaved, no activation
    checkpointing, 16M tokens per step (2,048 sequences)."""
    return ValidationPoint(
        f"Llama 3 405B, {128 * dp:,} GPUs", "Llama 3 Herd of Models, Table 4",
        load_spec("model_specs/llama.py:llama3-405b"),
        Layout(tp=8, pp=16, dp=dp, micro_batch=1, global_batch=2048, zero=1, recompute="none",
               schedule="interleaved", chunks=8, sequence_parallel=True, precision="bf16", overlap_comm=True),
        "h100-80gb", "mfu", mfu, MEGAZERO,
        assumed="micro-batch 1, sequence parallel, 8 chunks (what --search picks); FSDP without resharding, "
                "gradients reduce-scattered once per step, as ZeRO-1")


POINTS = (
    _zero3(GPT3, 384, 1536, "GPT-3 175B, ZeRO-3, 384 GPUs", 144),
    _zero3(GPT3, 768, 1536, "GPT-3 175B, ZeRO-3, 768 GPUs", 88),
    _zero3(GPT3, 1536, 1536, "GPT-3 175B, ZeRO-3, 1536 GPUs", 44),
    _zero3(MT530, 640, 2560, "530B, ZeRO-3, 640 GPUs", 138),
    _zero3(MT530, 1120, 2240, "530B, ZeRO-3, 1120 GPUs", 98),
    _zero3(MT530, 2240, 2240, "530B, ZeRO-3, 2240 GPUs", 48),
    _ptdp(GPT3, 12, 384, 1536, "GPT-3 175B, PTD-P, 384 GPUs", 153),
    _ptdp(GPT3, 12, 768, 1536, "GPT-3 175B, PTD-P, 768 GPUs", 149),
    _ptdp(GPT3, 12, 1536, 1536, "GPT-3 175B, PTD-P, 1536 GPUs", 141),
    _ptdp(MT530, 35, 560, 2240, "530B, PTD-P, 560 GPUs", 171),
    _ptdp(MT530, 35, 1120, 2240, "530B, PTD-P, 1120 GPUs", 167),
    _ptdp(MT530, 35, 2240, 2240, "530B, PTD-P, 2240 GPUs", 159),
    _korthikanti(_gpt(48, 6144, 64), 1, 1, 4, 4, False, "22B, full recompute", 1.42),
    _korthikanti(_gpt(48, 6144, 64), 1, 1, 4, 4, True, "22B, selective + SP", 1.10),
    _korthikanti(GPT3, 8, 3, 64, 1, False, "GPT-3 175B, full recompute", 18.13),
    _korthikanti(GPT3, 8, 3, 64, 1, True, "GPT-3 175B, selective + SP", 13.75),
    _korthikanti(MT530, 35, 3, 280, 1, False, "530B, full recompute", 49.05),
    _korthikanti(MT530, 35, 3, 280, 1, True, "530B, selective + SP", 37.83),
    _korthikanti(_gpt(128, 25600, 160), 64, 1, 512, 1, False, "1T, full recompute", 94.42),
    _korthikanti(_gpt(128, 25600, 160), 64, 1, 512, 1, True, "1T, selective + SP", 71.49),
    _korthikanti(MT530, 35, 3, 2240, 1, True, "530B, selective + SP, dp 8 (2240 GPUs)", 39.15, dp=8),
    _mtnlg(2240, 60.1),
    _mtnlg(2800, 50.2),
    _mtnlg(3360, 44.4),
    ValidationPoint(
        "BLOOM 176B, 384 GPUs", "BigScience tr11-176B-ml (training log, benchmark table)",
        load_spec("model_specs/gpt.py:bloom-176b"),
        Layout(tp=4, pp=12, dp=8, micro_batch=2, global_batch=2048, zero=1, recompute="full",
               partition="type:transformer|embedding", precision="bf16", overlap_comm=False),
        "a100-80gb", "step_s", 105.22, assumed="1F1B (DeepSpeed's pipeline)", memory_gb=59.0),
    _llama3(64, 0.43),
    _llama3(128, 0.41),
)
"""Every published point beyond Table 1 the planner is validated on."""
