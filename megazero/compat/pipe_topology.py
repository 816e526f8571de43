"""DeepSpeed's pipeline topologies (`deepspeed.runtime.pipe.topology`) and the engine's `grid`.

`ProcessTopology(axes, dims)` lays ranks out row-major over named axes (the last axis varies
fastest), as DeepSpeed's; `PipeModelDataParallelTopology(num_pp, num_mp, num_dp)` is axes
(pipe, data, model), `PipeDataParallelTopology(num_pp, num_dp)` (pipe, data). `as_megazero` turns
one into megazero's `Topology` (pipe -> pp, data -> dp, model -> tp, same order), which is how a
`PipelineModule(topology=...)` sets the layout. `PipelineParallelGrid` answers DeepSpeed's grid
queries (ranks, sizes, torch process groups) from an engine's ParallelContext: it creates no group.
"""
from __future__ import annotations

import itertools
from collections import namedtuple

from megazero.core.topology import Topology
from megazero.runtime.parallel_context import ParallelContext

_TO_MEGAZERO = {"pipe": "pp", "data": "dp", "model": "tp"}


class ProcessTopology:
    """Ranks <-> coordinates on named axes, row-major (DeepSpeed's class, same methods)."""

    def __init__(self, axes, dims):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology(axes={axes}, dims={dims}): one size per axis, each axis once")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"ProcessTopology dims={dims}: every size must be >= 1")
        self.axes, self.dims = list(axes), [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {self.ProcessCoord(*c): r for r, c in
                        enumerate(itertools.product(*(range(d) for d in self.dims)))}

    def get_rank(self, **coord_kwargs) -> int:
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank({coord_kwargs}): give every axis of {self.axes} (filter_match selects by some)")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"get_rank({coord_kwargs}): outside the topology's dims {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in set(omit_axes))

    def get_dim(self, axis) -> int:
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank):
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} not found in topology (world size {self.world_size()})")

    def get_axis_comm_lists(self, axis) -> list[list[int]]:
        """The rank lists whose coordinates differ only on `axis` ([] for an unknown axis)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            base = dict(zip(others, fixed))
            lists.append([self.mapping[self.ProcessCoord(**base, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis, idx) -> list[int]:
        i = self.axes.index(axis)
        return [r for c, r in self.mapping.items() if c[i] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

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
    """megazero's Topology of a DeepSpeed one: pipe -> pp, data -> dp, model -> tp, in the same order
    (ranks land on the same coordinates). Other axis names are refused."""
    unknown = [a for a in topology.axes if a not in _TO_MEGAZERO]
    if unknown:
        raise ValueError(f"topology axis {unknown[0]!r}: megazero lays out pipe, data and model (its pp, dp, tp)")
    return Topology(order=[_TO_MEGAZERO[a] for a in topology.axes],
                    **{_TO_MEGAZERO[a]: d for a, d in zip(topology.axes, topology.dims)})


def of_megazero(topology: Topology) -> ProcessTopology:
    """The DeepSpeed topology of megazero's pp, dp, tp grid (axes named pipe, data, model)."""
    back = {v: k for k, v in _TO_MEGAZERO.items()}
    axes = [a for a in topology.order if a in back]
    if topology.world_size != 1 and any(topology.size(a) > 1 for a in topology.order if a not in back):
        raise ValueError(f"{topology}: only pp, dp, tp have a DeepSpeed topology axis")
    return ProcessTopology([back[a] for a in axes], [topology.size(a) for a in axes])


class PipelineParallelGrid:
    """DeepSpeed's `engine.grid`: this rank's place on the pp x dp x tp grid and the torch process
    groups of its axes, read from the engine's `ParallelContext` (which built every group once;
    this creates none). DeepSpeed's "model parallel" group (all pp x tp ranks of one data-parallel
    replica) is not built by megazero: `get_model_parallel_group` is refused."""

    def __init__(self, pctx: ParallelContext):
        self.pctx = pctx
        self._topo = of_megazero(pctx.topology)
        self.global_rank = pctx.global_rank
        self.world_size = pctx.topology.world_size
        self.data_parallel_size, self.pipe_parallel_size = pctx.dp_size, pctx.pp_size
        self.model_parallel_size = self.slice_parallel_size = pctx.tp_size
        self.stage_id, self.data_parallel_id = pctx.pp_rank, pctx.dp_rank
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1

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
        return list(self.pctx.dp_group.ranks)

    def get_model_parallel_rank(self) -> int:
        """This rank's index among the pp x tp ranks of its data-parallel replica (DeepSpeed's)."""
        return self.stage_id * self.slice_parallel_size + self.get_slice_parallel_rank()

    def get_model_parallel_world_size(self) -> int:
        return self.pipe_parallel_size * self.slice_parallel_size

    def get_model_parallel_group(self):
        raise NotImplementedError("grid.get_model_parallel_group(): megazero builds no group of a replica's pp x tp "
                                  "ranks (nothing of its own uses one); use get_pipe_parallel_group() and "
                                  "get_slice_parallel_group() (tensor parallel)")

    def get_slice_parallel_rank(self) -> int:
        return self.pctx.tp_rank

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self):
        return self._pg(self.pctx.tp_group)

    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
    get_tensor_model_parallel_group = get_slice_parallel_group


__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "as_megazero", "of_megazero"]
