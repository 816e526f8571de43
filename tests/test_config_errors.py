"""The bad-config corpus: every case must fail with a ConfigError whose message names the key.

Each case is (id, source, overrides, world_size, expected substrings). `source` is YAML text, a dict
(written as JSON: megazero-shaped or DeepSpeed, told apart by the loader), or None (defaults).
The first expected substring is the offending key and must appear on the message's first line.
"""
from __future__ import annotations

import json

import pytest

from megazero.core.config import ConfigError, assert_supported, load_config, parse_overrides

CASES = [
    # unknown keys: YAML, dotlist, megazero JSON -> closest valid key
    ("yaml-typo-section", "trian:\n  steps: 5\n", [], None, ["trian", "'train'"]),
    ("yaml-typo-key", "train:\n  micro_batch: 2\n", [], None, ["train.micro_batch", "'train.micro_batch_size'"]),
    ("dotlist-typo", None, ["model.layrs=6"], None, ["model.layrs", "'model.layers'"]),
    ("dotlist-missing-section", None, ["micro_batch_size=4"], None,
     ["micro_batch_size", "'train.micro_batch_size'"]),
    ("json-typo", {"parallel": {"ppp": 2}}, [], None, ["parallel.ppp", "'parallel.pp'"]),
    ("yaml-typo-offload", "zero:\n  offload_optimizer:\n    devic: cpu\n", [], None,
     ["zero.offload_optimizer.devic", "'zero.offload_optimizer.device'"]),
    # wrong types: key and expected type
    ("type-int-word", None, ["train.steps=ten"], None, ["train.steps", "an integer", "'ten'"]),
    ("type-int-float", None, ["parallel.pp=1.5"], None, ["parallel.pp", "an integer"]),
    ("type-bool-as-int", "parallel:\n  tp: true\n", [], None, ["parallel.tp", "an integer"]),
    ("type-bool-word", None, ["zero.overlap_comm=maybe"], None, ["zero.overlap_comm", "true or false"]),
    ("type-section-scalar", "zero: 2\n", [], None, ["zero", "mapping"]),
    ("type-list-element", None, ["optimizer.betas=[0.9,high]"], None, ["optimizer.betas[1]", "a number"]),
    ("type-str-number", None, ["data.path=3"], None, ["data.path", "a string", "quote"]),
    ("type-nested-into-scalar", None, ["train.steps.x=1"], None, ["train.steps", "an integer"]),
    # batch rule and layout (with numbers)
    ("batch-inconsistent", None, ["train.micro_batch_size=2", "train.gradient_accumulation_steps=4",
                                  "train.global_batch_size=10"], 8, ["train.global_batch_size", "10", "64"]),
    ("batch-indivisible", None, ["train.micro_batch_size=4", "train.global_batch_size=10"], 2,
     ["train.global_batch_size", "not divisible", "8"]),
    ("layout-product", None, ["parallel.pp=2", "parallel.tp=2", "parallel.dp=3"], 8,
     ["parallel.pp x parallel.tp x parallel.dp", "12", "world size 8"]),
    ("layout-indivisible", None, ["parallel.pp=3"], 8, ["parallel.pp x parallel.tp", "3", "world size 8"]),
    ("world-size-zero", None, [], 0, ["world_size", "positive"]),
    # ZeRO
    ("offload-param-stage2", None, ["zero.stage=2", "zero.offload_param.device=cpu"], None,
     ["zero.offload_param.device", "zero.stage=3"]),
    ("offload-optimizer-stage0", None, ["zero.offload_optimizer.device=cpu"], None,
     ["zero.offload_optimizer.device", "stage >= 1"]),
    ("offload-nvme", None, ["zero.stage=3", "zero.offload_param.device=nvme"], None,
     ["zero.offload_param.device", "not supported yet"]),
    ("bucket-zero", None, ["zero.reduce_bucket_size=0"], None, ["zero.reduce_bucket_size", ">= 1"]),
    ("zero-stage-4", None, ["zero.stage=4"], None, ["zero.stage", "0, 1, 2 or 3"]),
    # precision / optimizer / scheduler
    ("precision-bad", None, ["precision=fp8"], None, ["precision", "'fp8'", "fp16"]),
    ("lr-negative", None, ["optimizer.lr=-0.1"], None, ["optimizer.lr", ">= 0"]),
    ("betas-range", None, ["optimizer.betas=[0.9,1.5]"], None, ["optimizer.betas", "[0, 1)"]),
    ("momentum-adam", None, ["optimizer.momentum=0.9"], None, ["optimizer.momentum", "sgd"]),
    ("optimizer-type", None, ["optimizer.type=adamm"], None, ["optimizer.type", "'adam'"]),
    ("scheduler-type", None, ["scheduler.type=cosin"], None, ["scheduler.type", "'cosine'"]),
    ("constant-warmup", None, ["scheduler.warmup_steps=10"], None, ["scheduler.warmup_steps", "WarmupLR"]),
    ("fp16-window", None, ["fp16.loss_scale_window=0"], None, ["fp16.loss_scale_window"]),
    ("clip-negative", None, ["gradient_clipping=-1"], None, ["gradient_clipping", ">= 0"]),
    # pipeline
    ("schedule-name", None, ["pipeline.schedule=1f1d"], None, ["pipeline.schedule", "'1f1b'"]),
    ("chunks-zero", None, ["pipeline.chunks=0"], None, ["pipeline.chunks", ">= 1"]),
    ("interleaved-one-chunk", None, ["pipeline.schedule=interleaved"], None, ["pipeline.chunks", ">= 2"]),
    ("chunks-without-interleaved", None, ["pipeline.chunks=2"], None, ["pipeline.chunks", "interleaved"]),
    ("interleaved-microbatches", None, ["parallel.pp=2", "pipeline.schedule=interleaved", "pipeline.chunks=2",
                                        "train.gradient_accumulation_steps=3"], 4,
     ["train.gradient_accumulation_steps", "multiple of num_stages (parallel.pp)", "m=3, p=2"]),
    ("interleaved-one-stage", None, ["parallel.pp=1", "pipeline.schedule=interleaved", "pipeline.chunks=2"], 1,
     ["pipeline.schedule", "num_stages >= 2 (parallel.pp)"]),
    ("partition-length", None, ["parallel.pp=2", "pipeline.partition=[1,2,3]"], None,
     ["pipeline.partition", "3 layer counts", "2 stages"]),
    ("partition-sum", None, ["parallel.pp=2", "model.layers=6", "pipeline.partition=[2,2]"], None,
     ["pipeline.partition", "sum to 4", "model.layers=6"]),
    ("partition-regex", None, ["pipeline.partition=type:[Block"], None, ["pipeline.partition", "regular expression"]),
    ("partition-method", None, ["pipeline.partition=param"], None, ["pipeline.partition", "'parameters'"]),
    # layout and model
    ("order-repeat", None, ["parallel.order=[pp,tp,tp]"], None, ["parallel.order", "once"]),
    ("sp-without-tp", None, ["parallel.sequence_parallel=true"], None, ["parallel.sequence_parallel", "tp > 1"]),
    ("hidden-heads", None, ["model.hidden=100", "model.heads=3"], None, ["model.hidden", "model.heads=3"]),
    ("heads-tp", None, ["parallel.tp=4", "model.heads=6"], None, ["model.heads", "parallel.tp=4"]),
    ("partition-stages", None, ["parallel.pp=4", "pipeline.partition=[1,1,1]"], None,
     ["pipeline.partition", "3 layer counts for parallel.pp x pipeline.chunks = 4 stages"]),
    ("override-dup", None, ["model.overrides.layers=3"], None, ["model.overrides.layers", "model.layers"]),
    ("spec-form", None, ["model.spec=a.py:b:c"], None, ["model.spec", "FILE.py"]),
    ("ckpt-policy-none", None, ["activation_checkpointing.partition_activations=true"], None,
     ["activation_checkpointing.partition_activations", "policy=full"]),
    ("cpu-ckpt-alone", None, ["activation_checkpointing.policy=full",
                              "activation_checkpointing.cpu_checkpointing=true"], None,
     ["activation_checkpointing.cpu_checkpointing", "partition_activations"]),
    ("backend", None, ["comm.backend=mpi"], None, ["comm.backend", "gloo"]),
    ("tokenizer", None, ["data.tokenizer=bpee"], None, ["data.tokenizer", "'bpe'"]),
    ("name-slash", None, ["name=a/b"], None, ["name", "without '/'"]),
    # DeepSpeed JSON
    ("ds-typo-nested", {"zero_optimization": {"stagee": 2}}, [], None,
     ["zero_optimization.stagee", "'zero_optimization.stage'", "DeepSpeed key"]),
    ("ds-typo-top", {"train_batch_sizee": 8, "zero_optimization": {"stage": 1}}, [], None,
     ["train_batch_sizee", "'train_batch_size'"]),
    ("ds-typo-only-key", {"trian_batch_size": 8}, [], None, ["trian_batch_size", "'train_batch_size'"]),
    ("ds-typo-offload", {"zero_optimization": {"stage": 2, "offload_optimizer": {"devices": "cpu"}}}, [], None,
     ["zero_optimization.offload_optimizer.devices", "'zero_optimization.offload_optimizer.device'"]),
    ("ds-fp16-and-bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, [], None,
     ["fp16.enabled", "bf16.enabled", "both"]),
    ("ds-unsupported-value", {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}, [], None,
     ["zero_optimization.zero_quantized_nontrainable_weights", "not supported yet"]),
    ("ds-unsupported-key", {"train_batch_size": 8, "zero_optimization": {"load_from_fp32_weights": True}}, [], None,
     ["zero_optimization.load_from_fp32_weights", "not supported yet"]),
    ("ds-misplaced-key", {"zero_optimization": {"stage": 2, "prescale_gradients": False}}, [], None,
     ["zero_optimization.prescale_gradients", "unknown DeepSpeed key", "did you mean 'prescale_gradients'"]),
    ("ds-monitor-on", {"train_batch_size": 8, "comet": {"enabled": True}}, [], None, ["comet", "not supported yet"]),
    ("ds-auto-lr", {"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, [], None,
     ["optimizer.params.lr", "auto", "optimizer.lr"]),
    ("ds-auto-fp16", {"fp16": {"enabled": "auto"}}, [], None, ["fp16.enabled", "auto"]),
    ("ds-optimizer-type", {"optimizer": {"type": "Adamm", "params": {}}}, [], None, ["optimizer.type", "'adam'"]),
    ("ds-optimizer-no-type", {"optimizer": {"params": {"lr": 0.1}}}, [], None, ["optimizer.type", "missing"]),
    ("ds-optimizer-lamb", {"optimizer": {"type": "Lamb", "params": {}}}, [], None,
     ["optimizer.type", "not supported yet"]),
    # warmup_max_lr other than optimizer.params.lr, or none, is no error: as in DeepSpeed, warmup_max_lr
    # is every group's peak, and without it WarmupLR peaks at each group's lr, WarmupDecayLR at 0.001
    ("ds-warmup-max-auto", {"optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
                            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}}, [], None,
     ["scheduler.params.warmup_max_lr", "auto", "scheduler.warmup_max_lr=..."]),
    ("ds-warmup-min-above-default-max", {"optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                                         "scheduler": {"type": "WarmupDecayLR",
                                                       "params": {"total_num_steps": 10, "warmup_num_steps": 5,
                                                                  "warmup_min_lr": 2e-3}}},
     [], None, ["scheduler.warmup_min_lr (DeepSpeed scheduler.params.warmup_min_lr)",
                "scheduler.warmup_max_lr=0.001", "got 0.002"]),
    ("ds-decay-no-total", {"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5}}}, [], None,
     ["scheduler.params.total_num_steps", "WarmupDecayLR"]),
    ("ds-type-error", {"train_batch_size": "eight"}, [], None, ["train_batch_size", "an integer"]),
    ("ds-stage-4", {"zero_optimization": {"stage": 4}}, [], None,
     ["zero.stage (DeepSpeed zero_optimization.stage)", "0, 1, 2 or 3"]),
    ("ds-batch-rule", {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                       "gradient_accumulation_steps": 2}, [], 4,
     ["train.global_batch_size (DeepSpeed train_batch_size)", "30", "32"]),
    ("ds-offload-param-stage2", {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, [], None,
     ["zero.offload_param.device (DeepSpeed zero_optimization.offload_param.device)", "zero.stage=3"]),
    ("ds-mixed", {"parallel": {"pp": 2}, "zero_optimization": {"stage": 1}}, [], None, ["parallel", "mixes"]),
    ("ds-section-scalar", {"zero_optimization": 2}, [], None, ["zero_optimization", "mapping"]),
]


def _load(tmp_path, source, overrides, world_size):
    if source is None:
        return load_config(None, overrides, world_size=world_size)
    if isinstance(source, str):
        path = tmp_path / "case.yaml"
        path.write_text(source)
    else:
        path = tmp_path / "case.json"
        path.write_text(json.dumps(source))
    return load_config(str(path), overrides, world_size=world_size)


@pytest.mark.parametrize("case_id,source,overrides,world_size,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_config_names_key(tmp_path, case_id, source, overrides, world_size, expected):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, source, overrides, world_size)
    msg = str(info.value)
    first_line = msg.splitlines()[0]
    assert expected[0] in first_line, f"{case_id}: key {expected[0]!r} not on first line of:\n{msg}"
    for part in expected[1:]:
        assert part in msg, f"{case_id}: {part!r} missing from:\n{msg}"


def test_layers_that_cannot_fill_the_stages_are_the_partitions_refusal():
    """2 blocks are 4 pipeline layers with the embedding and the head: 4 stages run (one layer each), 8 do not,
    refused before any process group with the partition's own message."""
    from megazero.engine import load_run_config

    cfg = load_run_config("configs/debug_gpt.yaml", ["parallel.pp=4", "parallel.tp=1", "model.layers=2",
                                                      "data.path=null", "train.global_batch_size=8"], world_size=4)
    assert cfg.parallel.pp == 4
    with pytest.raises(ConfigError, match=r"pipeline.partition: cannot split 4 layers into num_stages=8 x chunks=1"):
        load_run_config("configs/debug_gpt.yaml", ["parallel.pp=8", "parallel.tp=1", "model.layers=2",
                                                   "data.path=null", "train.global_batch_size=16"], world_size=8)


def test_corpus_is_large_enough():
    assert len(CASES) >= 25
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("item", ["train.steps", "=5", "+train.steps=5"])
def test_malformed_override(item):
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides([item])


def test_override_string_not_list():
    with pytest.raises(ConfigError, match="overrides"):
        parse_overrides("train.steps=5")


@pytest.mark.parametrize("name,body,expected", [
    ("missing.yaml", None, "no such config file"),
    ("bad.toml", "x = 1", "unknown config file type"),
    ("broken.json", "{\"train\": ", "invalid JSON at line 1"),
    ("list.json", "[1, 2]", "JSON object"),
    ("list.yaml", "- 1\n- 2\n", "mapping"),
    ("broken.yaml", "train: [1,\n", "invalid YAML"),
])
def test_bad_files_name_the_file(tmp_path, name, body, expected):
    path = tmp_path / name
    if body is not None:
        path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    assert str(path) in str(info.value) and expected in str(info.value)


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["optimizer.lr=-1", "pipeline.chunks=0", "precision=fp8"])
    lines = str(info.value).splitlines()
    assert {l.split(":")[0] for l in lines} >= {"optimizer.lr", "pipeline.chunks", "precision"}


@pytest.mark.parametrize("override,key", [
    ("zero.sub_group_size=1000", "zero.sub_group_size"),
    ("fp16.consecutive_hysteresis=true", "fp16.consecutive_hysteresis"),
    ("zero.round_robin_gradients=true", "zero.round_robin_gradients"),
    ("zero.max_reuse_distance=5", "zero.max_reuse_distance"),
    ("zero.gather_16bit_weights_on_model_save=true", "zero.gather_16bit_weights_on_model_save"),
    ("train.eval_steps=5", "train.eval_steps"),
])
def test_not_supported_yet_names_key(override, key):
    overrides = [override] + (["parallel.tp=2"] if "sequence" in override else [])
    cfg = load_config(None, overrides, world_size=2)
    with pytest.raises(ConfigError) as info:
        assert_supported(cfg)
    assert str(info.value).startswith(f"{key}: not supported yet")
