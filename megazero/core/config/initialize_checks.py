"""What `megazero.initialize` refuses about the objects a user passes it, before any process group (L0: no torch).

The engine describes what it was given as plain data (`BuiltModel`: what kind of model, its MoE layers'
ep_size, a PipelineModule's cut; a client optimizer's class family and parameter groups; Megatron's mpu
sizes) and these functions refuse what megazero cannot run, naming the config key or the argument and
what would be valid. They run at the top of `initialize`, after the config loaded
(`spec_checks.load_for_run`) and before megazero creates any process group; the one refusal left for
later is a PipelineModule built for another rank's stage, which the ranks find out together
(`megazero.pipeline.stage_agreement.agree_on_stage`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

from .errors import ConfigError
from .schema import Config
from .spec_checks import with_spec
from .validate import resolve

MODEL_KINDS = ("none", "spec", "pipeline", "module")


class BuiltModel(NamedTuple):
    """What `initialize` was given as its model, described for the checks.

    kind: "none" (the config's model.spec), "spec" (a spec string), "pipeline" (a PipelineModule) or
    "module" (any other nn.Module). type_name: the model's class name. moe_ep_sizes: the ep_size of each
    of its DeepSpeed-style MoE layers. num_stages, chunks: a PipelineModule's cut. checkpointed: a
    PipelineModule built with an activation checkpointer. spec_ref: the spec string (kind "spec")."""

    kind: str
    type_name: str = ""
    moe_ep_sizes: tuple[int, ...] = ()
    num_stages: Optional[int] = None
    chunks: Optional[int] = None
    checkpointed: bool = False
    spec_ref: Optional[str] = None


def one_config_source(args, config, config_params):
    """The one config given to `initialize`: `config`, `config_params` (DeepSpeed's older name) or
    `args.deepspeed_config` (DeepSpeed's command-line flag; `args.deepscale_config`, its deprecated name)."""
    given = {"config": config, "config_params": config_params,
             "args.deepspeed_config": getattr(args, "deepspeed_config", None) if args is not None else None,
             "args.deepscale_config": getattr(args, "deepscale_config", None) if args is not None else None}
    present = [k for k, v in given.items() if v is not None]
    if len(present) > 1:
        raise ConfigError(f"initialize: a config was given twice ({' and '.join(present)}); pass one of them")
    return given[present[0]] if present else None


def check_mpu(mpu, cfg: Config) -> None:
    """A Megatron-style `mpu` (DeepSpeed's model-parallel unit) is accepted when it describes the
    config's layout: megazero builds its own groups from parallel.pp / tp / dp, so an mpu with other
    sizes is refused, naming them."""
    def size(*names):
        for name in names:
            if hasattr(mpu, name):
                return int(getattr(mpu, name)())
        return 1

    theirs = {"tp": size("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"),
              "pp": size("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"),
              "dp": size("get_data_parallel_world_size")}
    ours = {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": cfg.parallel.dp}
    if theirs != ours:
        raise ConfigError(f"initialize(mpu=...): the mpu's layout {theirs} differs from the config's parallel section "
                          f"{ours}; megazero builds its own process groups from parallel.pp / parallel.tp / "
                          f"parallel.dp: set them to the mpu's sizes (or pass mpu=None)")


def check_model(cfg: Config, model: BuiltModel, client_optimizer: bool = False) -> Config:
    """The config the run builds with `model`: parallel.ep taken from its MoE layers, model.spec from a
    spec string; refuses what the model cannot run with (a layout a plain module cannot take, a
    PipelineModule cut otherwise than the config's pipeline, a checkpointing policy, the FLOPs profiler or
    the silent-error check it cannot serve, no model at all, a client optimizer for a model not built yet)."""
    if model.kind not in MODEL_KINDS:
        raise ValueError(f"BuiltModel.kind={model.kind!r}: one of {', '.join(MODEL_KINDS)}")
    built = model.kind in ("pipeline", "module")
    if model.moe_ep_sizes:
        cfg = _with_expert_parallel(cfg, model)
    p = cfg.parallel
    if p.cp > 1 and built:
        raise ConfigError(f"parallel.cp={p.cp}: context parallelism splits each sequence inside megazero's own "
                          f"attention; pass a model spec (model.spec), not a built {model.type_name}")
    if model.kind == "spec":
        cfg = with_spec(cfg, model.spec_ref)
    elif model.kind == "pipeline":
        _check_pipeline_module(model, cfg)
    elif model.kind == "module" and (p.tp > 1 or p.pp > 1):
        raise ConfigError(f"parallel.tp={p.tp}, parallel.pp={p.pp}: a plain nn.Module runs with tp = pp = 1 "
                          f"only; build it from megazero layers (a model spec or a PipelineModule)")
    elif model.kind == "module" and p.ep > 1 and not model.moe_ep_sizes:
        raise ConfigError(f"parallel.ep={p.ep} (DeepSpeed: expert_parallel.autoep_size): a plain nn.Module keeps its "
                          f"own MoE blocks, which megazero cannot split over ranks; build its MoE layers with "
                          f"megazero.moe.layer.MoE (DeepSpeed's, with ep_size), or the model from a megazero MoE "
                          f"spec (e.g. model_specs/llama.py:mixtral-8x7b; a Hugging Face Mixtral's weights load "
                          f"with megazero.models.hf.load_hf_state_dict), or set parallel.ep=1")
    policy = cfg.activation_checkpointing.policy
    if policy != "none" and built and not (model.kind == "pipeline" and model.checkpointed):
        raise ConfigError(f"activation_checkpointing.policy={policy}: the model was passed in already built, so "
                          f"initialize cannot checkpoint it; build it with build_pipeline_model(..., "
                          f"activation_checkpointer=ActivationCheckpointer.from_config(...)) or pass a model spec")
    if cfg.log.flops_profiler.enabled and model.kind != "module":
        raise ConfigError("log.flops_profiler.enabled (DeepSpeed: flops_profiler.enabled): the profiler counts one "
                          "module's forward, which a pipeline splits over its stages' instructions; it runs with "
                          "a plain nn.Module (use log.peak_tflops for the trainer's MFU)")
    r = cfg.resilience
    if model.kind == "module" and (r.silent_error_interval or r.silent_error_spike):
        raise ConfigError("resilience.silent_error_interval / silent_error_spike: the check reruns a pipeline "
                          "program (megazero's models, a PipelineModule); a plain nn.Module's engine runs the "
                          "user's own forward and backward, which it cannot replay")
    if model.kind == "none" and cfg.model.spec is None:
        raise ConfigError("model.spec: no model given; pass model=... or set model.spec "
                          "(e.g. model.spec=model_specs/gpt.py:debug)")
    if client_optimizer and not built:
        raise ConfigError("initialize(optimizer=...): a client optimizer takes over the model's parameters, which a "
                          "model spec builds only after the process groups exist; set the config's optimizer "
                          "section instead, or pass the model built (an nn.Module or a PipelineModule)")
    return cfg


def _with_expert_parallel(cfg: Config, model: BuiltModel) -> Config:
    """`cfg` with parallel.ep taken from the model's MoE layers' ep_size, as DeepSpeed takes it. Every layer
    must have the same ep_size (megazero builds one expert-parallel group), the config may not ask for
    another, and ep_size must divide dp."""
    sizes = sorted(set(model.moe_ep_sizes))
    if len(sizes) > 1:
        raise ConfigError(f"MoE layers with ep_size {sizes}: megazero builds one expert-parallel group per model "
                          f"(DeepSpeed: one per ep_size); give every MoE layer the same ep_size")
    ep = sizes[0]
    if cfg.parallel.ep not in (1, ep):
        raise ConfigError(f"parallel.ep={cfg.parallel.ep} (DeepSpeed: expert_parallel.autoep_size), but the model's "
                          f"MoE layers have ep_size={ep}; the layers decide: leave parallel.ep unset or set it to {ep}")
    if ep > 1 and model.kind == "pipeline":
        raise ConfigError(f"MoE(ep_size={ep}) inside a PipelineModule: expert parallelism runs in a plain nn.Module "
                          f"(any ZeRO stage) or in a model built from a megazero MoE spec; use ep_size=1 here")
    try:
        return resolve(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep)))
    except ConfigError as err:
        raise ConfigError(f"MoE layers' ep_size={ep} (parallel.ep is taken from them): {err}") from None


def _check_pipeline_module(model: BuiltModel, cfg: Config) -> None:
    """A user's PipelineModule must be cut as the config's pipeline is."""
    for what, mine, key, theirs in (("num_stages", model.num_stages, "parallel.pp", cfg.parallel.pp),
                                    ("chunks", model.chunks, "pipeline.chunks", cfg.pipeline.chunks)):
        if mine != theirs:
            raise ConfigError(f"{key}={theirs}, but the PipelineModule was built with {what}={mine}; "
                              f"build it with {what}={theirs} or set {key}={mine}")


CLIENT_FAMILIES = ("adamw", "adam", "sgd", "megazero")
"""A client optimizer's class, as the engine tells it: torch's AdamW, Adam, SGD, or megazero's Adam
classes (CPUAdam / FusedAdam / DeepSpeedCPUAdam, which carry ``adamw_mode`` in their groups); None: other."""


def client_update_rule(name: str, family: Optional[str], groups: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """(update rule, its hyper-parameters) of a client optimizer of class `name` and `family`
    (`CLIENT_FAMILIES` or None) with parameter `groups` (its param_groups: only the hyper-parameter keys
    are read), for the ZeRO optimizer to run instead. Refused, naming the argument: groups that differ in
    a setting the ZeRO optimizer runs once for all of them, amsgrad / maximize / nesterov, SGD's
    dampening, any other optimizer class."""
    first = groups[0]

    def same(key, default=None):
        values = {repr(g.get(key, default)) for g in groups}
        if len(values) > 1:
            raise ConfigError(f"initialize(optimizer={name}): parameter groups differ in {key} ({sorted(values)}); "
                              f"the ZeRO optimizer runs one {key} for all groups")
        return first.get(key, default)

    for key in ("amsgrad", "maximize", "nesterov"):
        if same(key, False):
            raise ConfigError(f"initialize(optimizer={name}({key}=True)): not supported by the ZeRO optimizer; "
                              f"use {key}=False")
    if family == "adamw":
        kind = "adamw"
    elif family == "adam":
        kind = "adamw" if same("decoupled_weight_decay", False) else "adam"
    elif family == "sgd":
        if same("dampening", 0.0):
            raise ConfigError(f"initialize(optimizer=SGD(dampening={first['dampening']})): the ZeRO optimizer's SGD "
                              "has no dampening; use dampening=0")
        kind = "sgd"
    elif family == "megazero":
        kind = "adamw" if same("adamw_mode") else "adam"
    else:
        raise ConfigError(f"initialize(optimizer={name}): the ZeRO optimizer can take over torch.optim.Adam, AdamW "
                          f"and SGD, and megazero.ops.adam.FusedAdam / DeepSpeedCPUAdam; for {name}, use one of "
                          f"those or set the config's optimizer section")
    return kind, {"lr": first["lr"], "betas": tuple(first.get("betas", (0.9, 0.999))), "eps": first.get("eps", 1e-8),
                  "weight_decay": first.get("weight_decay", 0.0), "momentum": first.get("momentum", 0.0),
                  "bias_correction": bool(same("bias_correction", True))}
