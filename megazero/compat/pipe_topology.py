"""DeepSpeed's pipeline topologies (`deepspeed.runtime.pipe.topology`) and the engine's `grid`, as views.

`ProcessTopology(axes, dims)` is a view over megazero's one rank map, `megazero.core.topology.Topology`
(`Topology.of(axes, dims)`: the same row-major layout, the last axis varying fastest, any axis names):
every query (`get_rank`, `get_coord`, `get_axis_comm_lists`, `filter_match`, `get_axis_list`, ...) is
answered by that Topology with DeepSpeed's return shapes. `PipeModelDataParallelTopology(num_pp, num_mp,
num_dp)` is axes (pipe, data, model), `PipeDataParallelTopology(num_pp, num_dp)` (pipe, data). `as_megazero`
is the same grid with megazero's axis names (pipe -> pp, data -> dp, model -> tp), which is how a
`PipelineModule(topology=...)` sets the layout; `of_megazero` the other way. `PipelineParallelGrid`
answers DeepSpeed's grid queries from an engine's ParallelContext: ranks and coordinates from its
Topology, torch process groups from the groups it built (it creates none).
"""
from __future__ import annotations

from collections import namedtuple

from megazero.core.topology import Topology
from megazero.runtime.parallel_context import ParallelContext

_TO_MEGAZERO = {"pipe": "pp", "data": "dp", "model": "tp"}


class ProcessTopology:
    """DeepSpeed's class (same constructor, attributes and methods), a view over `topology`, a
    `Topology` with DeepSpeed's axis names."""

    def __init__(self, axes, dims):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology(axes={axes}, dims={dims}): one size per axis, each axis once")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology dims={dims}: every size must be >= 1")
        self._view(Topology.of(list(axes), [int(d) for d in dims]))
        self.axes, self.dims = axes, dims  # DeepSpeed keeps the caller's lists

    @classmethod
    def over(cls, topology: Topology) -> "ProcessTopology":
        """The DeepSpeed view of `topology` (its axis names as they are)."""
        view = cls.__new__(cls)
        view._view(topology)
        return view

    def _view(self, topology: Topology) -> None:
        self.topology = topology
        self.axes, self.dims = list(topology.order), [topology.size(a) for a in topology.order]
        self.ProcessCoord = namedtuple("ProcessCoord", topology.order)

    @property
    def mapping(self) -> dict:
        """DeepSpeed's {ProcessCoord: rank}, in rank order (built on each read from the Topology)."""
        return {self.get_coord(r): r for r in range(self.topology.world_size)}

    def get_rank(self, **coord_kwargs) -> int:
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank({coord_kwargs}): give every axis of {self.axes} (filter_match selects by some)")
        return self.topology.rank(**coord_kwargs)

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in set(omit_axes))

    def get_dim(self, axis) -> int:
        return self.topology.size(axis) if axis in self.axes else 0

    def get_coord(self, rank):
        return self.ProcessCoord(**self.topology.position(rank))

    def get_axis_comm_lists(self, axis) -> list[list[int]]:
        """The rank lists whose coordinates differ only on `axis` ([] for an unknown axis)."""
        return self.topology.axis_groups(axis) if axis in self.axes else []

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinates equal `filter_kwargs` on the axes named ([] for a value off the grid)."""
        unknown = [a for a in filter_kwargs if a not in self.axes]
        if unknown:
            raise ValueError(f"filter_match({unknown[0]}=...): the topology's axes are {self.axes}")
        if any(not 0 <= v < self.get_dim(a) for a, v in filter_kwargs.items()):
            return []
        return self.topology.matching(**filter_kwargs)

    def get_axis_list(self, axis, idx) -> list[int]:
        if axis not in self.axes:
            raise ValueError(f"get_axis_list({axis!r}): the topology's axes are {self.axes}")
        return self.filter_match(**{axis: idx})

    def world_size(self) -> int:
        return self.topology.world_size

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Axes (pipe, data): data-parallel ranks adjacent."""

    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Axes (pipe, data, model): tensor-parallel ranks adjacent, then data, then pipeline."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def as_megazero(topology: ProcessTopology) -> Topology:
    """megazero's Topology of a DeepSpeed one: the same grid with pipe -> pp, data -> dp, model -> tp
    (ranks keep their coordinates). Other axis names are refused."""
    unknown = [a for a in topology.axes if a not in _TO_MEGAZERO]
    if unknown:
        raise ValueError(f"topology axis {unknown[0]!r}: megazero lays out pipe, data and model (its pp, dp, tp)")
    return topology.topology.renamed(_TO_MEGAZERO)


def of_megazero(topology: Topology) -> ProcessTopology:
    """The DeepSpeed view of megazero's pp, dp, tp grid (axes named pipe, data, model; its other axes,
    of size 1, left out)."""
    back = {v: k for k, v in _TO_MEGAZERO.items()}
    extra = [a for a in topology.order if a not in back and topology.size(a) > 1]
    if extra:
        raise ValueError(f"{topology}: only pp, dp, tp have a DeepSpeed topology axis (not {extra[0]})")
    axes = [a for a in topology.order if a in back]
    return ProcessTopology.over(Topology.of([back[a] for a in axes], [topology.size(a) for a in axes]))


class PipelineParallelGrid:
    """DeepSpeed's `engine.grid`: this rank's place on the pp x dp x tp grid (ranks, coordinates and
    DeepSpeed's rank lists read off the engine's Topology, through `of_megazero`) and the torch process
    groups of its axes (the engine's `ParallelContext` built every group once; this creates none). DeepSpeed's "model parallel" group (all pp x tp ranks of one data-parallel
    replica) is not built by megazero: `get_model_parallel_group` is refused."""

    def __init__(self, pctx: ParallelContext):
        self.pctx = pctx
        self._topo = of_megazero(pctx.topology)
        topo, me = self._topo, pctx.global_rank
        self.global_rank, self.world_size = me, topo.world_size()
        self.data_parallel_size = max(topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(topo.get_dim("pipe"), 1)
        self.model_parallel_size = self.slice_parallel_size = max(topo.get_dim("model"), 1)
        coord = topo.get_coord(me)
        self.stage_id, self.data_parallel_id = coord.pipe, coord.data
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # DeepSpeed's rank lists, read off the topology
        self.dp_groups = topo.get_axis_comm_lists("data")
        self.pipe_groups = topo.get_axis_comm_lists("pipe")
        self.dp_group = next(g for g in self.dp_groups if me in g)
        self.pp_group = next(g for g in self.pipe_groups if me in g)
        self.slice_group = next((g for g in topo.get_axis_comm_lists("model") if me in g), [me])
        replica = sorted(topo.get_axis_list("data", self.data_parallel_id))  # DeepSpeed's "model parallel" ranks
        self.ds_model_rank, self.ds_model_world_size = replica.index(me), len(replica)
        self.p2p_groups = [[r, g[(g.index(r) + 1) % len(g)]] for r in range(self.world_size)
                           for g in self.pipe_groups if r in g]

    @staticmethod
    def _pg(handle):
        return handle.pg  # None for a group of one rank (torch's collectives skip it; so does megazero)

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs) -> int:
        """The global rank of pipeline stage `stage_id` at this rank's other coordinates (or those given)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self):
        return self._pg(self.pctx.pp_group)

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self):
        return self._pg(self.pctx.dp_group)

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.dp_group)

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the pp x tp ranks of its data-parallel replica (DeepSpeed's)."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self):
        raise NotImplementedError("grid.get_model_parallel_group(): megazero builds no group of a replica's pp x tp "
                                  "ranks (nothing of its own uses one); use get_pipe_parallel_group() and "
                                  "get_slice_parallel_group() (tensor parallel)")

    def get_slice_parallel_rank(self) -> int:
        return self.slice_group.index(self.global_rank)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self._pg(self.pctx.tp_group)

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group


__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "as_megazero", "of_megazero"]
