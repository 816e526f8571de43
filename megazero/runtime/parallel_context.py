"""ParallelContext: every process group of a PP x DP x TP grid, built once and passed explicitly.

Why `new_group` rather than DeviceMesh: we need groups that are not mesh axes (the embedding group
of first and last pipeline stage for tied weights, model-parallel = pp x tp), we want two contexts
in one process to be fully independent (DeviceMesh keeps a process-wide registry of meshes), and
the same code must run on gloo and NCCL. A DeviceMesh for DCP can be built from the same Topology
when needed.

All ranks call `new_group` for every group in the same deterministic order (a torch requirement);
groups of one rank get no process group and their collectives are local no-ops.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch.distributed as dist

from megazero.runtime.comm import CommStats, GroupHandle
from megazero.runtime.hierarchical import Hierarchy, node_split
from megazero.runtime.order_check import OrderCheck, enabled_by_env
from megazero.core.topology import Topology


class ParallelContext:
    """Process groups for one Topology, and this rank's coordinates.

    Attributes: ``tp_group/tp_rank/tp_size`` and the same for ``dp``, ``pp`` and ``cp`` (context parallel: the
    ranks holding different tokens of the same sequences, `megazero.context_parallel`); ``dp_cp_group`` (the
    dp x cp ranks holding the same parameters, over which ZeRO reduces and shards: ``dp_group`` itself when
    cp is 1; the data is split over ``dp_group`` only);
    ``embedding_group`` (first + last pipeline stage),
    ``ep_group`` (expert parallel: `ep` consecutive dp ranks, which hold different experts) and
    ``edp_group`` (expert data parallel: the dp ranks holding the same experts; dp / ep of them) and
    ``edp_cp_group`` (those and their cp peers, over which expert gradients are reduced: ``edp_group`` at cp 1),
    ``world_group`` (every rank: the default process group itself, for global norms and agreement),
    ``background_group`` (every rank again, a gloo group of its own, built by its first use, which every
    rank makes together: an asynchronous checkpoint agrees and commits over it from a background thread,
    so its collectives never interleave with training's; a run without asynchronous saves never opens
    it, nor needs gloo's sockets between nodes), ``stats`` (CommStats shared by all of this context's
    groups), and ``pp_prev_rank/pp_next_rank`` (global ranks or None).

    Only groups megazero communicates over are created (no model-parallel pp x tp group, no second
    world group), and NCCL builds each communicator at its first collective (the default group is
    initialised without ``device_id``, `megazero.runtime.launch`): a group a run never uses costs nothing.

    `ranks_per_node`: consecutive global ranks per node (None: one node); every group knows its
    members' nodes, so CommStats counts what crosses them. `hierarchical`: the data-parallel groups
    (dp and edp) reduce and gather inside each node first, then between nodes
    (`megazero.runtime.hierarchical`), where every node holds the same number of their members.
    `hpz`: the size of ``hpz_group``, runs of that many consecutive dp ranks (ZeRO++'s secondary
    partition, `megazero.zero.zeropp`; 1: one rank each). `verify_order`: every group's operations go
    through one `OrderCheck` over the job's store (`comm.verify_order`); None: on when the environment
    sets ``MEGAZERO_VERIFY_ORDER=1`` (the test suite does). `order`: another object every group posts
    its operations to instead (`collective`/`p2p` as OrderCheck has them: the dry run's recorder).
    """

    def __init__(self, topology: Topology, timeout_s: float = 300.0, stats: CommStats | None = None, ep: int = 1,
                 ranks_per_node: int | None = None, hierarchical: bool = False, hpz: int = 1,
                 verify_order: bool | None = None, order=None):
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized and topology.world_size != 1:
            raise RuntimeError(f"the layout {topology} needs torch.distributed to be initialized first "
                               "(torchrun, or megazero's launcher)")
        world = dist.get_world_size() if initialized else 1
        if world != topology.world_size:
            raise ValueError(f"the layout {topology} needs {topology.world_size} ranks, "
                             f"but the world size is {world}")
        self.topology = topology
        self.global_rank = dist.get_rank() if initialized else 0
        self.coords = topology.coords(self.global_rank)
        self.stats = stats if stats is not None else CommStats()
        self.timeout_s = timeout_s
        if ranks_per_node is not None and (ranks_per_node < 1 or world % ranks_per_node):
            raise ValueError(f"parallel.ranks_per_node={ranks_per_node} must be a positive divisor of the world "
                             f"size {world}")
        self.ranks_per_node = ranks_per_node or world
        self.hierarchical = hierarchical
        self._pg_cache: dict[tuple[int, ...], object] = {}
        check = enabled_by_env() if verify_order is None else verify_order
        if order is None and check and world > 1:
            order = OrderCheck(dist.distributed_c10d._get_default_store(), self.global_rank,
                               hang_s=max(30.0, timeout_s / 2))
        self.order = order
        self.tp_group = self._build("tp", topology.axis_groups("tp"))
        self.dp_group = self._build_data_parallel("dp", topology.axis_groups("dp"))
        self.pp_group = self._build("pp", topology.axis_groups("pp"))
        self.cp_group = self._build("cp", topology.axis_groups("cp"))
        # the replicas of every parameter: the dp ranks and, with context parallelism, their cp ranks (which hold
        # other tokens of the same sequences); gradients are averaged and ZeRO shards over it
        self.dp_cp_group = self.dp_group if topology.size("cp") == 1 else \
            self._build_data_parallel("dp_cp", topology.axis_groups("dp", "cp"))
        self.embedding_group = self._build("embedding", topology.embedding_groups())
        self.ep_group = self._build("ep", topology.expert_groups(ep))
        self.edp_group = self._build_data_parallel("edp", topology.expert_data_groups(ep))
        self.edp_cp_group = self.edp_group if topology.size("cp") == 1 else \
            self._build_data_parallel("edp_cp", topology.expert_data_cp_groups(ep))
        self.hpz_group = self._build("hpz", topology.data_parallel_runs(hpz))  # ZeRO++ hpZ: k consecutive dp ranks
        self.world_group = self._world(world)
        self._background: GroupHandle | None = None
        self.pp_prev_rank, self.pp_next_rank = topology.pipeline_peers(self.global_rank)

    def _build(self, axis: str, groups: list[list[int]]) -> GroupHandle:
        """Create (collectively, on every rank) the process groups of one axis; return ours."""
        mine = None
        for ranks in groups:
            key = tuple(ranks)
            if len(ranks) == 1:
                continue
            if len(ranks) > 1 and key not in self._pg_cache:
                self._pg_cache[key] = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout_s))
            if self.global_rank in ranks:
                mine = key
        if mine is None:
            mine = (self.global_rank,)
        if len(mine) == 1:  # not a member of any group of this axis (embedding groups on middle stages)
            return GroupHandle(axis, (self.global_rank,), 0, None, self.stats, self.timeout_s)
        return GroupHandle(axis, mine, mine.index(self.global_rank), self._pg_cache.get(mine),
                           self.stats, self.timeout_s, nodes=tuple(r // self.ranks_per_node for r in mine),
                           order=self.order)

    def _build_data_parallel(self, axis: str, groups: list[list[int]]) -> GroupHandle:
        """`_build`, plus, when hierarchical and the group spans several nodes evenly, its intra- and
        inter-node groups (axes ``<axis>.intra`` / ``<axis>.inter``; built on every rank in the same order)."""
        handle = self._build(axis, groups)
        if not self.hierarchical:
            return handle
        splits = [node_split(g, self.ranks_per_node) for g in groups]
        if any(s is None or len(s[0]) == 1 or len(s[1]) == 1 for s in splits):
            return handle  # uneven over the nodes, or one node / one rank per node: the flat ring is the same
        intra = self._build(axis + ".intra", [g for s in splits for g in s[0]])
        inter = self._build(axis + ".inter", [g for s in splits for g in s[1]])
        return dataclasses.replace(handle, hierarchy=Hierarchy(intra, inter))

    def _world(self, world: int) -> GroupHandle:
        """Every rank, over the default process group (no communicator of its own)."""
        if world == 1:
            return GroupHandle("world", (0,), 0, None, self.stats, self.timeout_s)
        return GroupHandle("world", tuple(range(world)), self.global_rank, dist.group.WORLD, self.stats,
                           self.timeout_s, nodes=tuple(r // self.ranks_per_node for r in range(world)),
                           order=self.order)

    @property
    def background_group(self) -> GroupHandle:
        """See the class docstring: created at the first access, which every rank must make (the first
        asynchronous save: every rank saves)."""
        if self._background is None:
            self._background = self._build_background(self.topology.world_size)
        return self._background

    def _build_background(self, world: int) -> GroupHandle:
        """A second world group on gloo (host objects, any device) with its own CommStats: it is used
        from another thread while training's groups are busy."""
        pg = None
        if world > 1:
            backend = None if dist.get_backend() == "fake" else "gloo"  # the dry run's recording group: its own
            pg = dist.new_group(list(range(world)), timeout=timedelta(seconds=self.timeout_s), backend=backend)
            self._pg_cache[("background",)] = pg
        return GroupHandle("background", tuple(range(world)), self.global_rank, pg, CommStats(), self.timeout_s,
                           order=self.order)

    # -- convenience --------------------------------------------------------------------
    tp_rank = property(lambda self: self.tp_group.rank)
    tp_size = property(lambda self: self.tp_group.size)
    dp_rank = property(lambda self: self.dp_group.rank)
    dp_size = property(lambda self: self.dp_group.size)
    pp_rank = property(lambda self: self.pp_group.rank)
    pp_size = property(lambda self: self.pp_group.size)
    cp_rank = property(lambda self: self.cp_group.rank)
    cp_size = property(lambda self: self.cp_group.size)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def in_embedding_group(self) -> bool:
        return self.is_first_stage or self.is_last_stage

    def describe(self) -> str:
        c = self.coords
        return f"rank {self.global_rank} (pp={c.pp}, dp={c.dp}, tp={c.tp})"

    def destroy(self) -> None:
        """Destroy this context's process groups (the default group stays) and stop its order check."""
        if self.order is not None:
            self.order.close()
        for pg in self._pg_cache.values():
            dist.destroy_process_group(pg)
        self._pg_cache.clear()
