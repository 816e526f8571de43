"""DeepSpeed JSON: documented config forms load unchanged and map onto megazero's schema."""
from __future__ import annotations

import json
import os
import re

import pytest

from megazero.core.config import ConfigError, from_deepspeed, is_deepspeed, load_config, resolve, translate
from megazero.core.config import deepspeed_keys
from megazero.core.config.deepspeed import defaults_applied

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def _ds(name: str) -> str:
    return os.path.join(CONFIGS, name)


def test_zero2_cpu_offload_fp16():
    cfg = load_config(_ds("ds_zero2_cpu_offload.json"), world_size=4)
    assert cfg.precision == "fp16" and cfg.fp16.loss_scale == 0.0 and cfg.fp16.initial_scale_power == 16
    z = cfg.zero
    assert z.stage == 2 and z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert z.offload_param.device == "none" and z.overlap_comm and z.contiguous_gradients
    assert z.reduce_bucket_size == z.allgather_bucket_size == 200_000_000
    t = cfg.train
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size) == (4, 2, 32)
    assert cfg.optimizer.type == "adamw" and cfg.optimizer.lr == 2e-4 and cfg.optimizer.betas == [0.9, 0.95]
    assert cfg.optimizer.weight_decay == 0.1
    assert cfg.scheduler.type == "WarmupLR" and cfg.scheduler.warmup_steps == 100
    assert cfg.scheduler.warmup_type == "log"  # DeepSpeed's WarmupLR default
    assert cfg.gradient_clipping == 1.0 and cfg.log.interval == 50
    assert cfg.name == "ds_zero2_cpu_offload"


def test_zero3_param_offload_bf16():
    cfg = load_config(_ds("ds_zero3_param_offload.json"), world_size=8)
    z = cfg.zero
    assert cfg.precision == "bf16" and z.stage == 3
    assert z.offload_param.device == "cpu" and z.offload_param.pin_memory
    assert z.prefetch_bucket_size == 10_000_000 and z.param_persistence_threshold == 100_000
    assert z.max_live_parameters == z.max_reuse_distance == z.sub_group_size == 1_000_000_000
    assert z.gather_16bit_weights_on_model_save
    assert cfg.train.global_batch_size == 1 * 8 * 8
    assert cfg.optimizer.type == "adam" and cfg.optimizer.adamw_mode is True  # DeepSpeed's Adam decouples decay
    assert cfg.scheduler.type == "WarmupDecayLR" and cfg.scheduler.total_steps == 10_000
    assert cfg.scheduler.warmup_steps == 500 and cfg.optimizer.lr == 1e-4


def test_fp16_dynamic_and_deprecated_zero_bool():
    cfg = load_config(_ds("ds_fp16_dynamic.json"), world_size=2)
    f = cfg.fp16
    assert cfg.precision == "fp16"
    got = (f.loss_scale, f.initial_scale_power, f.loss_scale_window, f.hysteresis, f.min_loss_scale)
    assert got == (0, 12, 500, 2, 1)
    assert cfg.zero.stage == 1  # "zero_optimization": true
    assert (cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps) == (4, 2)
    assert cfg.activation_checkpointing.policy == "none" and cfg.activation_checkpointing.number_checkpoints is None


def test_auto_values_are_derived():
    cfg = load_config(_ds("ds_auto_batch.json"), ["model.hidden=256"], world_size=4)
    t = cfg.train
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size) == (2, 1, 8)
    assert cfg.zero.reduce_bucket_size == 256 * 256
    assert cfg.zero.prefetch_bucket_size == int(0.9 * 256 * 256)
    assert cfg.zero.param_persistence_threshold == 2560
    assert cfg.precision == "bf16" and cfg.fp16.initial_scale_power == 16  # fp16 block ignored: disabled
    without_hidden = load_config(_ds("ds_auto_batch.json"), world_size=4)
    assert without_hidden.zero.reduce_bucket_size == 500_000_000


def test_from_deepspeed_matches_file_and_overrides_apply():
    with open(_ds("ds_zero2_cpu_offload.json")) as f:
        data = json.load(f)
    cfg = from_deepspeed(data)
    assert cfg.train.global_batch_size == 32 and cfg.parallel.dp is None  # unresolved
    from_file = load_config(_ds("ds_zero2_cpu_offload.json"), ["name=ds_zero2_cpu_offload"], world_size=4)
    assert resolve(cfg, 4).zero == from_file.zero
    both = load_config(_ds("ds_zero2_cpu_offload.json"), ["parallel.pp=2", "zero.stage=1"], world_size=4)
    assert both.parallel.dp == 2 and both.zero.stage == 1 and both.train.gradient_accumulation_steps == 4


@pytest.mark.parametrize("ds,expected", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, ("adamw", True)),
    ({"optimizer": {"type": "adam", "params": {"lr": 1e-3, "adam_w_mode": False}}}, ("adam", False)),
    ({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": False}}}, ("sgd", None)),
])
def test_optimizer_types(ds, expected):
    cfg = resolve(from_deepspeed(ds), 1)
    assert (cfg.optimizer.type, cfg.optimizer.adamw_mode) == expected


def test_deprecated_cpu_offload_keys():
    cfg = from_deepspeed({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                "cpu_offload_use_pin_memory": True}})
    assert cfg.zero.offload_optimizer.device == cfg.zero.offload_param.device == "cpu"
    assert cfg.zero.offload_optimizer.pin_memory and cfg.zero.offload_param.pin_memory
    off = from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert off.zero.offload_optimizer.device == "none"



def test_offload_pin_memory_keys_map_and_default_as_deepspeeds():
    """zero_optimization.offload_*.pin_memory map onto zero.offload_*.pin_memory; absent, both are true in
    megazero's schema and in a DeepSpeed JSON, as DeepSpeed's own offload configs default (the oracle)."""
    offload = pytest.importorskip("deepspeed.runtime.zero.offload_config")
    oracle = (offload.DeepSpeedZeroOffloadOptimizerConfig().pin_memory,
              offload.DeepSpeedZeroOffloadParamConfig().pin_memory)
    assert oracle == (True, True)

    def pins(cfg):
        return cfg.zero.offload_optimizer.pin_memory, cfg.zero.offload_param.pin_memory

    assert pins(load_config()) == oracle
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    assert pins(from_deepspeed({"zero_optimization": zero})) == oracle
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "offload_param": {"device": "cpu", "pin_memory": True}}
    assert pins(from_deepspeed({"zero_optimization": zero})) == (False, True)
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": False}}
    assert pins(from_deepspeed({"zero_optimization": zero})) == (True, False)
    # the deprecated spelling sets both, both ways; the new spelling wins where both are given
    assert pins(from_deepspeed({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                      "cpu_offload_use_pin_memory": False}})) == (False, False)
    both = {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}, "cpu_offload_use_pin_memory": False}
    assert pins(from_deepspeed({"zero_optimization": both})) == (True, False)
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload_use_pin_memory"):
        from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload_use_pin_memory": "yes"}})


@pytest.mark.parametrize("ds", [
    {"tensorboard": {"enabled": False, "output_path": "x"}},
    {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/nvme", "buffer_count": 5}}},
    {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.0}}},
    {"fp16": {"enabled": True, "auto_cast": True}},
    {"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "amsgrad": False}}},
    {"prescale_gradients": False, "gradient_predivide_factor": 1.0, "communication_data_type": None},
    {"data_types": {"grad_accum_dtype": "fp32"}, "zero_allow_untested_optimizer": True},
    {"checkpoint": {"tag_validation": "Ignore", "load_universal": False}},
    {"zero_optimization": {"stage": 2, "ignore_unused_parameters": True, "elastic_checkpoint": False}},
])
def test_documented_noops_load(ds):
    from_deepspeed(ds)


@pytest.mark.parametrize("ds,key", [
    ({"prescale_gradients": True}, "prescale_gradients"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "zero_optimization.offload_optimizer.ratio"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, "optimizer.params.amsgrad"),
    ({"pipeline": {"seed_layers": True}}, "pipeline.seed_layers"),
    ({"checkpoint": {"tag_validation": "Fail"}}, "checkpoint.tag_validation"),
    ({"scheduler": {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4}}}, "scheduler.type"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": [1e-4, 1e-5], "cycle_max_lr": 1e-3}}},
     "scheduler.params.cycle_min_lr"),
    ({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "last_batch_iteration": 4}}},
     "scheduler.params.last_batch_iteration"),
])
def test_unsupported_values_raise(ds, key):
    with pytest.raises(ConfigError, match="not supported yet") as info:
        from_deepspeed(ds)
    assert str(info.value).startswith(key)


def test_fp16_disabled_block_is_ignored_like_deepspeed():
    cfg = from_deepspeed({"fp16": {"enabled": False, "loss_scale": 128, "hysteresis": 9}})
    assert cfg.precision == "fp32" and cfg.fp16.loss_scale == 0.0 and cfg.fp16.hysteresis == 2


@pytest.mark.parametrize("data,expected", [
    ({"train_batch_size": 8}, True),
    ({"zero_optimization": {"stage": 1}}, True),
    ({"optimizer": {"type": "Adam", "params": {}}}, True),
    ({"fp16": {"enabled": True}}, True),
    ({"train": {"steps": 3}}, False),
    ({"optimizer": {"type": "adam", "lr": 0.1}}, False),
    ({"gradient_clipping": 1.0}, False),
])
def test_is_deepspeed(data, expected):
    assert is_deepspeed(data) is expected


def test_translate_labels_name_deepspeed_keys():
    tree, labels = translate({"train_micro_batch_size_per_gpu": 2,
                              "zero_optimization": {"stage3_max_live_parameters": 5}})
    assert tree["train"] == {"micro_batch_size": 2} and tree["zero"] == {"max_live_parameters": 5}
    assert labels["zero.max_live_parameters"] == "zero_optimization.stage3_max_live_parameters"


def test_key_table_is_documented():
    """Every DeepSpeed key the translator knows appears in the module docstring's table."""
    doc = deepspeed_keys.__doc__
    for rule in deepspeed_keys.RULES:
        leaf = rule.ds.rsplit(".", 1)[-1]
        assert leaf in doc, f"{rule.ds} missing from the deepspeed_keys table"
    targets = {r.target for r in deepspeed_keys.RULES} - {None, deepspeed_keys.SPECIAL}
    from megazero.core.config import all_keys
    assert targets <= set(all_keys()), targets - set(all_keys())


def test_the_pipeline_section_maps_key_by_key():
    cfg = from_deepspeed({"train_micro_batch_size_per_gpu": 2, "pipeline": {
        "stages": 2, "partition": "uniform", "pipe_partitioned": True, "grad_partitioned": True,
        "activation_checkpoint_interval": 0, "seed_layers": False}})
    assert cfg.parallel.pp == 2 and cfg.pipeline.partition == "uniform"
    assert from_deepspeed({"pipeline": {"stages": "auto"}}).parallel.pp == 1  # initialize takes the module's
    with pytest.raises(ConfigError, match="activation_checkpoint_interval.*PipelineModule"):
        from_deepspeed({"pipeline": {"activation_checkpoint_interval": 2}})


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(os.path.dirname(__file__), "configs"))
                                        if f.startswith("ds_")))
def test_a_dict_and_its_file_give_the_same_config(name):
    """DeepSpeed's documented configs (getting started, ZeRO-2/3 offload, fp16, the HF Trainer's with
    its "auto" values, a pipeline, each of the four schedulers): the dict passed to initialize and the
    same JSON file resolve to one Config, values kept typed (no YAML re-parsing of strings)."""
    path = _ds(name)
    with open(path) as f:
        data = json.load(f)
    from_file = load_config(path, ["name=x"], world_size=4)
    from_dict = load_config(data, ["name=x"], world_size=4)
    assert from_file == from_dict
    assert from_dict.gradient_clipping == data.get("gradient_clipping", 1.0)  # DeepSpeed's default when unset


def test_warmup_cosine_lr_maps_key_by_key_with_deepspeeds_defaults():
    sched = {"type": "WarmupCosineLR", "params": {"total_num_steps": 500, "warmup_min_ratio": 0.1,
                                                  "warmup_num_steps": 50, "cos_min_ratio": 0.02,
                                                  "warmup_type": "linear", "last_batch_iteration": -1}}
    cfg = resolve(from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}, "scheduler": sched}), 1)
    s = cfg.scheduler
    assert (s.type, s.total_steps, s.warmup_steps, s.warmup_type) == ("WarmupCosineLR", 500, 50, "linear")
    assert (s.warmup_min_ratio, s.cos_min_ratio) == (0.1, 0.02)
    assert cfg.optimizer.lr == 3e-4  # the ratios scale the optimizer's lr (each group's own)
    bare = from_deepspeed({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 500}}}).scheduler
    assert (bare.warmup_steps, bare.warmup_type, bare.warmup_min_ratio, bare.cos_min_ratio) == (1000, "log", 0.0, 0.0001)


@pytest.mark.parametrize("name, params, peak", [
    ("WarmupLR", {"warmup_max_lr": 2e-3}, 2e-3),  # differs from optimizer.params.lr: the scheduler's wins
    ("WarmupDecayLR", {"warmup_max_lr": 5e-4, "total_num_steps": 50}, 5e-4),
    ("WarmupLR", {}, None),  # DeepSpeed's WarmupLR without warmup_max_lr: each group's own lr
    ("WarmupDecayLR", {"total_num_steps": 50}, 0.001),  # DeepSpeed's WarmupDecayLR default, whatever the lr
])
def test_warmup_max_lr_is_the_schedulers_peak_as_in_deepspeed(name, params, peak):
    """DeepSpeed's WarmupLR / WarmupDecayLR set every group's lr from their first step: warmup_max_lr is
    every group's peak, whatever optimizer.params.lr (which stays the optimizer's lr, the lr of the groups
    that set none); without it WarmupLR peaks at each group's lr, WarmupDecayLR at 0.001. None of these
    is an error (tests/test_lr_schedule.py checks the lrs against DeepSpeed's)."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "scheduler": {"type": name, "params": {"warmup_num_steps": 10, **params}}}
    tree, labels = translate(ds)
    assert tree["optimizer"]["lr"] == 1e-2 and tree["scheduler"].get("warmup_max_lr") == peak
    if peak is not None:
        assert labels["scheduler.warmup_max_lr"] == "scheduler.params.warmup_max_lr"
    cfg = resolve(from_deepspeed(ds), 1)
    assert cfg.optimizer.lr == 1e-2 and cfg.scheduler.warmup_max_lr == peak
    no_optimizer = resolve(from_deepspeed({"scheduler": ds["scheduler"]}), 1)  # a client optimizer's groups
    assert no_optimizer.scheduler.warmup_max_lr == peak


def test_deepspeed_scheduler_defaults_are_explained():
    lines = defaults_applied({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 50}}})
    assert "scheduler.warmup_max_lr: 0.001  # scheduler.params.warmup_max_lr unset: DeepSpeed's WarmupDecayLR " \
           "default (megazero's own is each parameter group's own lr)" in lines
    assert any(line.startswith("scheduler.warmup_steps: 1000") for line in lines)
    assert any(line.startswith("scheduler.warmup_type: log") for line in lines)
    lines = defaults_applied({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})
    assert not any(line.startswith(("scheduler.warmup_max_lr", "scheduler.warmup_steps")) for line in lines)


def test_one_cycle_maps_key_by_key_with_deepspeeds_defaults():
    params = {"cycle_min_lr": 1e-5, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.1, "cycle_first_step_size": 100,
              "cycle_second_step_size": 200, "cycle_first_stair_count": 4, "cycle_second_stair_count": 8,
              "decay_step_size": 10, "cycle_momentum": False, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
              "decay_mom_rate": 0.01, "last_batch_iteration": -1}
    tree, labels = translate({"scheduler": {"type": "OneCycle", "params": params}})
    expected = {k: v for k, v in params.items() if k != "last_batch_iteration"}
    assert tree["scheduler"] == {"type": "OneCycle", **expected}  # no warmup keys: OneCycle has none
    assert labels["scheduler.cycle_first_step_size"] == "scheduler.params.cycle_first_step_size"
    s = resolve(from_deepspeed({"scheduler": {"type": "OneCycle", "params": params}}), 1).scheduler
    assert {k: getattr(s, k) for k in expected} == expected
    bare = from_deepspeed({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1}}})
    b = bare.scheduler
    assert (b.decay_lr_rate, b.cycle_first_step_size, b.cycle_second_step_size, b.cycle_first_stair_count,
            b.cycle_second_stair_count, b.decay_step_size) == (0.0, 2000, None, 0, None, 0)
    assert (b.cycle_momentum, b.cycle_min_mom, b.cycle_max_mom, b.decay_mom_rate) == (True, 0.8, 0.9, 0.0)


@pytest.mark.parametrize("sched, key, needle", [
    ({"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5}}, "scheduler.params.total_num_steps", "required"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_num_steps": 0}},
     "scheduler.warmup_steps (DeepSpeed scheduler.params.warmup_num_steps)", ">= 1"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "cos_min_ratio": 1.5}},
     "scheduler.cos_min_ratio (DeepSpeed scheduler.params.cos_min_ratio)", "[0, 1]"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_min_ratio": -0.1}},
     "scheduler.warmup_min_ratio (DeepSpeed scheduler.params.warmup_min_ratio)", "[0, 1]"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_type": "exp"}},
     "scheduler.warmup_type (DeepSpeed scheduler.params.warmup_type)", "linear, log"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_max_lr": 1e-3}},
     "scheduler.params.warmup_max_lr", "not a parameter of DeepSpeed's WarmupCosineLR"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}, "scheduler.params.total_num_steps", "auto"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}, "scheduler.params.cycle_max_lr", "required by OneCycle"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 0}},
     "scheduler.cycle_first_step_size (DeepSpeed scheduler.params.cycle_first_step_size)", ">= 1"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_second_step_size": -2}},
     "scheduler.cycle_second_step_size (DeepSpeed scheduler.params.cycle_second_step_size)", ">= 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": -1e-4, "cycle_max_lr": 1e-3}},
     "scheduler.cycle_min_lr (DeepSpeed scheduler.params.cycle_min_lr)", ">= 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_max_mom": 1.2}},
     "scheduler.cycle_max_mom (DeepSpeed scheduler.params.cycle_max_mom)", "[0, 1)"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_step_size": -1}},
     "scheduler.decay_step_size (DeepSpeed scheduler.params.decay_step_size)", ">= 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": -0.5}},
     "scheduler.decay_lr_rate (DeepSpeed scheduler.params.decay_lr_rate)", ">= 0"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_momentum": "yes"}},
     "scheduler.params.cycle_momentum", "true or false"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_stair_count": 2.5}},
     "scheduler.params.cycle_first_stair_count", "an integer"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "warmup_num_steps": 10}},
     "scheduler.params.warmup_num_steps", "OneCycle takes cycle_min_lr"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 0}},
     "scheduler.warmup_steps (DeepSpeed scheduler.params.warmup_num_steps)", ">= 1 with scheduler.type=WarmupLR"),
    ({"type": "WarmupDecayLR", "params": {"total_num_steps": 9, "warmup_max_lr": 1e-3, "warmup_num_steps": 0}},
     "scheduler.warmup_steps (DeepSpeed scheduler.params.warmup_num_steps)", ">= 1 with scheduler.type=WarmupDecayLR"),
    ({"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "cycle_min_lr": 1e-4}},
     "scheduler.params.cycle_min_lr", "not a parameter of DeepSpeed's WarmupLR"),
    ({"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_min_lrr": 1e-3}},
     "scheduler.params.cycle_min_lrr", "cycle_min_lr"),
    ({"type": "LRRangeTest", "params": {}}, "scheduler.type", "valid: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"),
])
def test_bad_scheduler_values_name_the_key(sched, key, needle):
    with pytest.raises(ConfigError) as info:
        load_config({"scheduler": sched}, world_size=1)
    assert str(info.value).startswith(key) and needle in str(info.value), str(info.value)


@pytest.mark.parametrize("overrides, needle", [
    (["scheduler.type=OneCycle"], "scheduler.cycle_min_lr: required by scheduler.type=OneCycle"),
    (["scheduler.type=WarmupCosineLR"], "scheduler.warmup_steps: must be >= 1 with scheduler.type=WarmupCosineLR"),
    (["scheduler.type=OneCyle"], "'OneCycle'"),
    (["scheduler.type=WarmupLR"], "scheduler.warmup_steps: must be >= 1 with scheduler.type=WarmupLR"),
    (["scheduler.type=WarmupDecayLR", "scheduler.warmup_steps=4", "scheduler.min_lr=1e-5"],
     "scheduler.min_lr: WarmupDecayLR takes none (as DeepSpeed's, WarmupDecayLR decays to scheduler.warmup_min_lr)"),
    (["scheduler.type=cosine", "scheduler.warmup_max_lr=1e-3"],
     "scheduler.warmup_max_lr: applies to scheduler.type=WarmupLR and WarmupDecayLR only, not cosine"),
    (["scheduler.type=WarmupLR", "scheduler.warmup_steps=4", "scheduler.warmup_max_lr=-1e-3"],
     "scheduler.warmup_max_lr: must be >= 0"),
    (["scheduler.type=WarmupLR", "scheduler.warmup_steps=4", "scheduler.warmup_max_lr=1e-3",
      "scheduler.warmup_min_lr=2e-3"], "scheduler.warmup_min_lr: must be in [0, scheduler.warmup_max_lr=0.001]"),
])
def test_megazero_format_scheduler_checks(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, overrides, world_size=1)
    ok = load_config(None, ["scheduler.type=OneCycle", "scheduler.cycle_min_lr=1e-4", "scheduler.cycle_max_lr=1e-3",
                            "scheduler.cycle_first_step_size=10"], world_size=1)
    assert ok.scheduler.cycle_max_lr == 1e-3 and ok.scheduler.cycle_second_step_size is None


_AUTOEP = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}


def test_autoep_section_maps_to_expert_parallelism_like_the_megazero_keys():
    """DeepSpeed's AutoEP section on a megazero MoE spec: the same Config as the megazero keys it stands
    for (the routing keys "auto" / null keep the model's; DeepSpeed's expert TP default 1 applies)."""
    ds = dict(_AUTOEP, expert_parallel={
        "enabled": True, "autoep_size": 2, "preset_model": "mixtral", "top_k": "auto", "score_func": "softmax",
        "route_norm": None, "routed_scaling_factor": "auto", "route_scale": 1.0, "load_balance_coeff": None,
        "use_grouped_mm": True, "combine_impl": "auto", "comm_backend": "comm"})
    spec = ["model.spec=model_specs/llama.py:debug-moe"]
    from_ds = load_config(ds, spec, world_size=4)
    assert from_ds.parallel.ep == 2 and from_ds.parallel.expert_tp == 1 and from_ds.model.moe.score == "softmax"
    assert from_ds.model.moe.top_k is None and from_ds.model.moe.normalize_topk is None  # the spec's
    plain = dict(_AUTOEP)
    mine = load_config(plain, spec + ["parallel.ep=2", "parallel.expert_tp=1", "model.moe.score=softmax"],
                       world_size=4)
    assert from_ds == mine
    tuned = load_config(dict(_AUTOEP, expert_parallel={"enabled": True, "autoep_size": 4, "top_k": 1,
                                                       "score_func": "sigmoid", "route_norm": False}),
                        spec, world_size=4)
    assert (tuned.parallel.ep, tuned.model.moe.top_k, tuned.model.moe.score, tuned.model.moe.normalize_topk) == (
        4, 1, "sigmoid", False)
    assert any("parallel.expert_tp: 1" in line for line in defaults_applied(ds))


def test_a_disabled_autoep_section_is_not_read_like_deepspeed():
    cfg = from_deepspeed(dict(_AUTOEP, expert_parallel={"enabled": False, "autoep_size": 8, "comm_backend": "deepep"}))
    assert cfg.parallel.ep == 1 and cfg.model.moe.top_k is None


@pytest.mark.parametrize("section,key,words", [
    ({"comm_backend": "deepep"}, "expert_parallel.comm_backend", "not supported yet (DeepEP)"),
    ({"num_expert_groups": 4}, "expert_parallel.num_expert_groups", "not supported yet (group-limited routing)"),
    ({"route_scale": 2.5}, "expert_parallel.route_scale", "not supported yet"),
    ({"autoep_sise": 2}, "expert_parallel.autoep_sise", "autoep_size"),
])
def test_bad_autoep_keys_name_the_key(section, key, words):
    with pytest.raises(ConfigError) as info:
        from_deepspeed(dict(_AUTOEP, expert_parallel={"enabled": True, **section}))
    assert str(info.value).startswith(key) and words in str(info.value), str(info.value)
