"""PipelineModule: a model given as a list of layer specs, of which each rank builds only its own.

In the spirit of DeepSpeed's pipeline API so users can migrate: `LayerSpec(cls, *args, **kw)`
defers construction; `TiedLayerSpec(key, cls, ..., tied_weight_attr="weight", forward_fn=None)`
marks layers that share a weight (input embedding and LM head). With one pipeline stage tied
layers are one module; across stages each end builds its own copy (same layout-invariant init),
whose weight carries `tied_name = key` so the ZeRO optimizer sums its gradient over the embedding
group. Plain `nn.Module`s and functions (``lambda x: x.float()``) are accepted as layers too.

The layers are split into `num_stages * chunks` virtual stages by `megazero/core/partition.py`; stage s holds
virtual stages s, s + p, s + 2p, ... (Megatron's interleaved layout).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from megazero.core import partition as part
from megazero.core.flops import weight_flops
from megazero.core.launch_env import read_launch_env
from megazero.core.instructions import virtual_stage
from megazero.runtime.seeding import set_random_seed


class LayerSpec:
    """Deferred `typename(*args, **kwargs)`."""

    def __init__(self, typename, *args, **kwargs):
        if not callable(typename):
            raise TypeError(f"LayerSpec needs a class or factory, got {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    @property
    def name(self) -> str:
        return getattr(self.typename, "__name__", type(self.typename).__name__)

    def __repr__(self) -> str:
        return f"LayerSpec({self.name})"


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` parameter is shared with every other spec of the same key.
    `forward_fn(module, x)` replaces `module(x)` (e.g. the LM head reusing the embedding)."""

    def __init__(self, key: str, typename, *args, forward_fn=None, tied_weight_attr: str = "weight", **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn, self.tied_weight_attr = key, forward_fn, tied_weight_attr


def _count_params(layer) -> int:
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            return sum(p.numel() for p in layer.build().parameters())
    return 0  # a plain function


def describe_layers(layers) -> list[part.LayerInfo]:
    """Per-layer (type name, parameter count, cost) for partitioning, read off the layers: a
    LayerSpec is built on the meta device to count; the cost is 2 x parameters (GEMM FLOPs per
    token, `megazero.core.flops.weight_flops`). Builders that know better pass `layer_infos` to
    `PipelineModule` instead."""
    out = []
    for layer in layers:
        if isinstance(layer, LayerSpec):
            name = layer.name
        elif isinstance(layer, nn.Module):
            name = type(layer).__name__
        else:
            name = getattr(layer, "__name__", "fn")  # a user's function or callable object
        n = _count_params(layer)
        out.append(part.LayerInfo(name=name, params=n, flops=weight_flops(n)))
    return out


class PipelineModule(nn.Module):
    """This rank's share of a layer list: `chunks` model chunks of consecutive layers.

    Args:
        layers: LayerSpec / TiedLayerSpec / nn.Module / callable, in model order.
        num_stages, stage: pipeline size and this rank's stage (pctx.pp_size, pctx.pp_rank). Without
            `stage` (DeepSpeed's way), it is this process' stage on DeepSpeed's default grid: pipeline
            outermost, then data (`stage_of_this_process`); `megazero.initialize` checks it against
            the config's grid.
        loss_fn: `loss_fn(output, labels)` on the last virtual stage.
        partition_method: "uniform", "parameters", "type:<regex>", "flops" or a list of per-(virtual-)
            stage layer counts.
        chunks: model chunks per stage (v, for the interleaved schedule).
        input_key, label_key: micro-batch dict keys of the first layer's input and of the labels; a
            micro-batch may also be DeepSpeed's ``(inputs, labels)`` pair (`as_batch`).
        activation_checkpoint_interval: DeepSpeed's: recompute every run of that many consecutive
            layers of a chunk in backward (torch.utils.checkpoint, non-reentrant, RNG restored);
            0 = off. `activation_checkpoint_func(function, x)` replaces torch's checkpoint (DeepSpeed's
            argument, e.g. `megazero.checkpointing.checkpoint`); with `checkpointable_layers` (class
            names) only runs holding one of them are recomputed.
        topology: DeepSpeed's `ProcessTopology` (e.g. `PipeModelDataParallelTopology`): the pipeline
            size and this rank's stage come from it, and `megazero.initialize` lays out pp, dp, tp in
            its order.
        seed_layers, seed_fn, base_seed: DeepSpeed's: each layer is built (or taken) right after
            ``seed_fn(base_seed + index)`` (default `set_random_seed`), index its position in `layers`.

    What the engine needs beyond the layers, all optional (a user's module declares none of them):
        layer_infos: one `megazero.core.partition.LayerInfo` per layer (type name, parameters, cost);
            default: read off the layers by `describe_layers`.
        activation_shape: `activation_shape(micro_batch_size) -> shape` of the tensors between stages,
            known ahead; None: the stages agree on each boundary's shape and dtype on the first
            micro-batch (`megazero.pipeline.p2p`).
        model_spec: the `ModelSpec` the layers were built from (sizes the engine's data and the
            trainer's summary); None for a user's layers.
        activation_checkpointer: the `ActivationCheckpointer` that wrapped the blocks; the module
            groups its blocks into segments per chunk at construction.
        wgrad_store: the `WeightGradStore` the layers' linears were built with (zero bubble: their
            weight GEMMs move from B to W); None: W computes nothing the B did not already hold.
        on_batch: ``on_batch(batch)`` before each chunk's forward, on every stage, with its micro-batch
            (packed documents: the layers follow the micro-batch's documents); every stage then loads the
            micro-batches (`batch_everywhere`). None: only the first and last virtual stage read them.
    """

    def __init__(self, layers, num_stages: int | None = None, stage: int | None = None, loss_fn=None,
                 partition_method="parameters", chunks: int = 1, input_key: str = "input_ids",
                 label_key: str = "labels", *, activation_checkpoint_interval: int = 0, topology=None,
                 seed_layers: bool = False, seed_fn=None, base_seed: int = 1234, activation_checkpoint_func=None,
                 checkpointable_layers=None, layer_infos=None, activation_shape=None, model_spec=None,
                 activation_checkpointer=None, wgrad_store=None, on_batch=None):
        super().__init__()
        layers = list(layers)
        num_stages, stage = _stages(num_stages, stage, topology)
        if activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval={activation_checkpoint_interval}: must be >= 0 (0 = off)")
        self.checkpoint_interval = activation_checkpoint_interval
        self.checkpoint_func = activation_checkpoint_func  # None: torch.utils.checkpoint, non-reentrant
        self.checkpointable_layers = None if checkpointable_layers is None else set(checkpointable_layers)
        self.topology = topology
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.num_stages, self.stage_index, self.chunks = num_stages, stage, chunks
        self.loss_fn, self.input_key, self.label_key = loss_fn, input_key, label_key
        self.activation_shape, self.model_spec = activation_shape, model_spec
        self.activation_checkpointer, self.wgrad_store = activation_checkpointer, wgrad_store
        self.on_batch = on_batch
        infos = list(layer_infos) if layer_infos is not None else describe_layers(layers)
        if len(infos) != len(layers):
            raise ValueError(f"layer_infos has {len(infos)} entries for {len(layers)} layers")
        self.bounds = part.partition(infos, num_stages, partition_method, chunks)
        self.local_chunks = nn.ModuleList()
        self._forward_fns: list[list] = []
        self.layer_ranges = []
        tied_modules: dict[str, nn.Module] = {}
        for c in range(chunks):
            lo, hi = self.bounds[virtual_stage(stage, c, num_stages)], self.bounds[virtual_stage(stage, c, num_stages) + 1]
            self.layer_ranges.append((lo, hi))
            mods, fns = nn.ModuleList(), []
            for index, spec in enumerate(layers[lo:hi], start=lo):
                if seed_layers:  # DeepSpeed's: before each layer (built or not), its own seed
                    (seed_fn or set_random_seed)(base_seed + index)
                mod, fn = self._build(spec, tied_modules)
                mods.append(mod if isinstance(mod, nn.Module) else _Fn(mod))
                fns.append(fn)
            self.local_chunks.append(mods)
            self._forward_fns.append(fns)
        if activation_checkpointer is not None:
            activation_checkpointer.attach(self.local_chunks)

    @staticmethod
    def _build(spec, tied_modules):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied_modules:
                mod = spec.build()
                weight = _get_attr(mod, spec.tied_weight_attr)
                weight.tied_name = spec.key
                tied_modules[spec.key] = mod
            return tied_modules[spec.key], spec.forward_fn
        if isinstance(spec, LayerSpec):
            return spec.build(), None
        return spec, None

    # -- the `Stage` protocol of megazero.pipeline.executor ----------------------------------------
    def virtual_stage(self, chunk: int) -> int:
        return virtual_stage(self.stage_index, chunk, self.num_stages)

    def is_first(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual_stage(chunk) == self.num_stages * self.chunks - 1

    @property
    def batch_everywhere(self) -> bool:
        """Whether every stage reads the micro-batches (an `on_batch` hook), not only the first and the last."""
        return self.on_batch is not None

    def as_batch(self, item) -> dict:
        """A micro-batch as the stages read it: a dict as it is, DeepSpeed's (inputs, labels) pair as
        {input_key: inputs, label_key: labels}."""
        if isinstance(item, dict):
            return item
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return {self.input_key: item[0], self.label_key: item[1]}
        raise TypeError(f"a pipeline micro-batch must be a dict or an (inputs, labels) pair, got "
                        f"{type(item).__name__}" + (f" of {len(item)}" if isinstance(item, (tuple, list)) else ""))

    def forward_chunk(self, chunk: int, x, batch=None):
        """Run local chunk `chunk` on `x` (the micro-batch's input on the first virtual stage); with
        activation_checkpoint_interval, each run of that many layers is recomputed in backward."""
        if self.on_batch is not None:
            self.on_batch(batch)
        if self.is_first(chunk):
            x = batch[self.input_key]
        steps = list(zip(self.local_chunks[chunk], self._forward_fns[chunk]))
        span = self.checkpoint_interval or len(steps) or 1
        for lo in range(0, len(steps), span):
            if self.checkpoint_interval and torch.is_grad_enabled() and self._checkpointable(steps[lo:lo + span]):
                if self.checkpoint_func is not None:  # DeepSpeed's activation_checkpoint_func(function, *args)
                    x = self.checkpoint_func(_RunLayers(steps[lo:lo + span]), x)
                else:
                    x = torch.utils.checkpoint.checkpoint(_run_layers, steps[lo:lo + span], x, use_reentrant=False)
            else:
                x = _run_layers(steps[lo:lo + span], x)
        return x

    def _checkpointable(self, steps) -> bool:
        """DeepSpeed's rule: with `checkpointable_layers`, a run is recomputed only if one of its layers'
        class names is listed; otherwise every run is (layers without parameters included)."""
        if self.checkpointable_layers is None:
            return True
        return any(type(getattr(mod, "fn", mod)).__name__ in self.checkpointable_layers for mod, _ in steps)

    def loss(self, out, batch):
        if self.loss_fn is None:
            raise ValueError("PipelineModule needs loss_fn on the last stage")
        return self.loss_fn(out, batch[self.label_key])

    def chunk_parameters(self, chunk: int):
        seen = set()
        for p in self.local_chunks[chunk].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p

    def units(self) -> list[nn.Module]:
        """The layer modules in forward order (ZeRO-3 gathers parameters per unit)."""
        return [m for chunk in self.local_chunks for m in chunk if any(True for _ in m.parameters())]

    def forward(self, batch):
        """Whole-model forward for a single stage holding every layer (pp=1, chunks=1)."""
        if self.num_stages != 1 or self.chunks != 1:
            raise RuntimeError("PipelineModule.forward runs only with one stage and one chunk; use an engine")
        return self.loss(self.forward_chunk(0, None, batch), batch)


def _run_layers(steps, x):
    for mod, fn in steps:
        x = fn(mod, x) if fn is not None else mod(x)
    return x


class _RunLayers:
    """`_run_layers` over fixed steps, as the one-argument function a checkpoint function takes."""

    def __init__(self, steps):
        self.steps = steps

    def __call__(self, x):
        return _run_layers(self.steps, x)


def _world() -> tuple[int, int]:
    """(rank, world size): torch.distributed's when initialized, else the launcher's (`read_launch_env`)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    env = read_launch_env(os.environ)
    return env.rank, env.world_size


def _stages(num_stages, stage, topology) -> tuple[int, int]:
    """(num_stages, this rank's stage) from the arguments: DeepSpeed's `topology` (any object with
    `get_dim("pipe")` and `get_coord(rank).pipe`, e.g. PipeModelDataParallelTopology) or
    `num_stages`; the stage on DeepSpeed's default grid when not given."""
    if topology is not None:
        piped = topology.get_dim("pipe")
        if num_stages is not None and num_stages != piped:
            raise ValueError(f"PipelineModule(num_stages={num_stages}, topology=...): the topology has {piped} "
                             f"pipeline stages; give one of them")
        if stage is None:
            rank, world = _world()
            if topology.world_size() != world:
                raise ValueError(f"PipelineModule(topology=...): the topology has {topology.world_size()} ranks, "
                                 f"the world {world}")
            stage = topology.get_coord(rank).pipe
        return piped, stage
    if num_stages is None:
        raise ValueError("PipelineModule: give num_stages or topology (DeepSpeed's PipeModelDataParallelTopology)")
    return num_stages, stage if stage is not None else stage_of_this_process(num_stages)


def stage_of_this_process(num_stages: int) -> int:
    """This process' pipeline stage on DeepSpeed's default grid (pipeline outermost, then data; no
    tensor parallelism): global rank // (world size / num_stages). Rank and world size come from
    torch.distributed when it is initialized, else from the launcher's RANK / WORLD_SIZE."""
    rank, world = _world()
    if num_stages < 1 or world % num_stages:
        raise ValueError(f"PipelineModule(num_stages={num_stages}): the world size {world} is not a multiple of it")
    return rank // (world // num_stages)


class _Fn(nn.Module):
    """Wraps a plain function as a parameter-free layer."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _get_attr(mod: nn.Module, dotted: str):
    obj = mod
    for part_name in dotted.split("."):
        obj = getattr(obj, part_name)
    return obj


