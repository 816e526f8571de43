"""Point-to-point transfers between pipeline stages over the pp group.

Two paths, chosen per `PipeP2P` from the pp group's backend (or by whoever builds it):

- blocking (gloo, and any backend but NCCL): `comm.send`/`comm.recv` of one tensor at a time (never
  gloo's batched isend/irecv, which can hang: pytorch#132644); a schedule that the simulator
  accepts cannot deadlock with these rendezvous semantics.
- batched (NCCL, as Megatron and torch pipelining): the executor hands each run of consecutive
  p2p instructions of a program to one `P2PBatch`; their tensors go out in one
  `comm.batch_isend_irecv` and are waited on together before the next compute instruction. NCCL
  progresses the ops of one batch independently (those with the same peer in order), so this only
  drops the blocking path's waits between the transfers of a run: each is posted no later, the run
  ends no earlier, and ops between two stages in one direction still pair up in program order.
  Programs that cannot deadlock blocking therefore cannot deadlock batched. A metadata message (see
  below) travels alone: the ops posted so far are issued and waited first, then the message as a
  batch of one, so it sits exactly where the blocking path sends it, on the same communicator as
  the rest. The first batch of a step is preceded by `PipeP2P.connect` (once per PipeP2P).

What crosses a boundary is one tensor or, as in DeepSpeed's pipeline engine, a tuple of tensors
(e.g. hidden states and an attention mask). Floating-point tensors carry a gradient back; integer and
bool tensors travel downstream only. Each *boundary* between virtual stages v and v + 1 carries the
activations of v (downstream) and the gradients of their floating-point tensors (upstream, same
shapes and dtypes). Receive buffers need shapes and dtypes. Either:

- the shape is declared ahead (`act_shape`, e.g. a model spec's (s, b, h)): every boundary carries
  one tensor of it in `dtype`, and no metadata ever travels; or
- it is learned on the first micro-batch (a user's `PipelineModule` that declares nothing): the
  first activation sent across a boundary is preceded by one small int64 message with the number of
  tensors and each one's shape and dtype; both ends cache it. A later activation of another
  structure, shape or dtype is an error that names the stage, the boundary and both shapes, raised
  on the sending stage before anything is sent.
"""
from __future__ import annotations

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle, PeerOp

MAX_DIMS = 8
MAX_TENSORS = 16  # tensors in one activation tuple
FLOATING = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# The code of a dtype is its index here: the floating-point ones first (they carry gradients).
DTYPES = FLOATING + (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
ENTRY = MAX_DIMS + 2  # int64s per tensor in the metadata message: ndim, dtype code, shape


def tensors_of(value) -> tuple[torch.Tensor, ...]:
    """The tensors of an activation (one tensor, or a tuple or list of tensors), in order."""
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


def carries_grad(tensor: torch.Tensor) -> bool:
    """Whether this activation tensor sends a gradient back upstream (floating point)."""
    return tensor.dtype in FLOATING


def _as_value(tensors, is_tuple: bool):
    """Tensors received back in the sender's structure: one tensor, else a tuple (grads of a
    boundary without floating-point tensors: an empty tuple)."""
    return tensors[0] if not is_tuple and len(tensors) == 1 else tuple(tensors)


class P2PBatch:
    """The sends and receives of consecutive p2p instructions over `group`, posted together by
    `flush` as one `comm.batch_isend_irecv` and waited on together. Until `flush` returns, receive
    buffers are unfilled; the batch holds every tensor it sends until then."""

    def __init__(self, group: GroupHandle):
        self.group = group
        self.ops: list[PeerOp] = []

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Send `tensor` to group rank `peer` with the batch."""
        self.ops.append(PeerOp("send", tensor, peer))

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Receive into `tensor` from group rank `peer` with the batch."""
        self.ops.append(PeerOp("recv", tensor, peer))

    def flush(self) -> None:
        """Post the ops gathered so far as one batch over the group and wait for all of them."""
        ops, self.ops = self.ops, []
        for work in comm.batch_isend_irecv(ops, self.group):
            comm.wait(work, self.group)  # timed: a straggler's peers wait here
        for op in ops:  # what arrived, in the posted order (the silent-error check's fingerprints)
            if op.kind == "recv":
                comm.note(self.group, "in", op.tensor)

    def alone(self, kind: str, tensor: torch.Tensor, peer: int) -> None:
        """A message that must not wait for the ops after it (a boundary's metadata): flush what is
        posted, then move this one as a batch of its own."""
        self.flush()
        self.ops.append(PeerOp(kind, tensor, peer))
        self.flush()


class PipeP2P:
    """Sends and receives activations and their gradients to/from stage `peer` of `pp_group`
    (the group's ranks are ordered by pipeline stage); `stage` is this rank's stage.

    Args:
        act_shape: the shape of every activation between stages (one tensor), or None to learn each
            boundary's structure, shapes and dtypes from its first activation.
        dtype: the dtype activations travel in when `act_shape` is given (the compute dtype).
        batched: whether the executor batches runs of consecutive transfers (`P2PBatch`, NCCL's
            batch_isend_irecv) instead of moving one tensor at a time blocking; None decides from the
            pp group's backend on `device`: batched on NCCL only (gloo's batches can hang).
    """

    def __init__(self, pp_group: GroupHandle, act_shape: tuple[int, ...] | None, dtype: torch.dtype,
                 device: torch.device | str = "cpu", batched: bool | None = None):
        self.group, self.dtype, self.device = pp_group, dtype, device
        self.declared = tuple(act_shape) if act_shape is not None else None
        self.batched = comm.backend(pp_group, device) == "nccl" if batched is None else bool(batched)
        self.connected = False  # batched: whether the pp group's first collective ran (`connect`)
        # boundary -> (((shape, dtype) per tensor), sent as a tuple?)
        self.known: dict[int, tuple[tuple[tuple[tuple[int, ...], torch.dtype], ...], bool]] = {}

    def batch(self) -> P2PBatch:
        """An empty batch over the pp group, for the transfers of one run of p2p instructions."""
        return P2PBatch(self.group)

    def connect(self) -> None:
        """Batched only, a barrier over the pp group (every stage calls it at the start of each
        step; only the first does anything): torch's batch_isend_irecv needs the group's first
        collective to involve all of its ranks, and a pipeline's first batch involves two."""
        if self.batched and not self.connected:
            comm.barrier(self.group)
            self.connected = True

    # -- activations (downstream) -----------------------------------------------------------------
    def send_activation(self, value, peer: int, boundary: int, batch: P2PBatch | None = None) -> None:
        """Send the activation crossing `boundary` (virtual stage `boundary` -> `boundary + 1`) to stage
        `peer`, one tensor after another (with `batch`: posted to it); the first one across an
        undeclared boundary is preceded by its structure, shapes and dtypes (alone, with `batch`)."""
        tensors, is_tuple = self._tensors(value, boundary)
        if self.declared is not None:
            if is_tuple:
                raise TypeError(f"virtual stage {boundary} returned a tuple, but this model declares one activation "
                                f"of shape {self.declared} between stages")
            self._check(tensors[0], boundary, self.declared, self.dtype, "declared activation shape")
            self._send(tensors[0].detach().to(self.dtype).contiguous(), peer, batch)
            return
        if boundary not in self.known:
            meta = _encode([(t.shape, t.dtype) for t in tensors], is_tuple, self.device)  # refuses before caching
            self.known[boundary] = (tuple((tuple(t.shape), t.dtype) for t in tensors), is_tuple)
            self._send(meta, peer, batch, alone=True)
        else:
            metas, was_tuple = self.known[boundary]
            if was_tuple != is_tuple or len(metas) != len(tensors):
                raise ValueError(f"virtual stage {boundary} returned {_describe(tensors, is_tuple)}, but its first "
                                 f"micro-batch returned {_describe(metas, was_tuple)}; every micro-batch must give "
                                 f"the same activations between stages")
            for t, (shape, dtype) in zip(tensors, metas):
                self._check(t, boundary, shape, dtype, "first micro-batch's activation")
        for t in tensors:
            self._send(t.detach().contiguous(), peer, batch)

    def recv_activation(self, peer: int, boundary: int, batch: P2PBatch | None = None):
        """Receive the activation crossing `boundary` from stage `peer` into new buffers: a tensor,
        or a tuple when the sender sent one (with `batch`: filled once it is flushed; a metadata
        message is received alone, first)."""
        if self.declared is None and boundary not in self.known:
            meta = torch.empty(2 + MAX_TENSORS * ENTRY, dtype=torch.int64, device=self.device)
            if batch is None:
                comm.recv(meta, peer, self.group)
            else:
                batch.alone("recv", meta, peer)
            self.known[boundary] = _decode(meta)
        metas, is_tuple = self._meta(boundary)
        return _as_value([self._recv(peer, shape, dtype, batch) for shape, dtype in metas], is_tuple)

    # -- gradients (upstream) ---------------------------------------------------------------------
    def send_grad(self, grads, peer: int, boundary: int, batch: P2PBatch | None = None) -> None:
        """Send back to stage `peer` the gradients of the floating-point tensors that crossed
        `boundary`: a tensor when one tensor crossed it, else a tuple (possibly empty); with
        `batch`, posted to it."""
        floats = self._grad_metas(boundary)
        grads = tensors_of(grads) if grads is not None else ()
        if len(grads) != len(floats):
            raise ValueError(f"pipeline gradient from virtual stage {boundary + 1} back to {boundary}: "
                             f"{len(grads)} tensors for the {len(floats)} floating-point activations that crossed")
        for g, (shape, dtype) in zip(grads, floats):
            self._check(g, boundary, shape, None, "activation's shape", what="gradient")
            self._send(g.detach().to(dtype).contiguous(), peer, batch)

    def recv_grad(self, peer: int, boundary: int, batch: P2PBatch | None = None):
        """Receive the gradients of the floating-point tensors this stage sent across `boundary`
        (with `batch`: filled once it is flushed)."""
        grads = [self._recv(peer, shape, dtype, batch) for shape, dtype in self._grad_metas(boundary)]
        return _as_value(grads, self._meta(boundary)[1])

    # -- helpers ----------------------------------------------------------------------------------
    def _tensors(self, value, boundary: int) -> tuple[tuple[torch.Tensor, ...], bool]:
        is_tuple = not isinstance(value, torch.Tensor)
        if not (isinstance(value, torch.Tensor) or (isinstance(value, (tuple, list))
                                                    and all(isinstance(t, torch.Tensor) for t in value))):
            got = type(value).__name__ if not isinstance(value, (tuple, list)) else \
                f"{type(value).__name__} of {', '.join(type(t).__name__ for t in value)}"
            raise TypeError(f"virtual stage {boundary} returned a {got}; what a pipeline stage passes on must be "
                            f"a tensor or a tuple of tensors")
        tensors = tensors_of(value)
        if is_tuple and not 1 <= len(tensors) <= MAX_TENSORS:
            raise ValueError(f"virtual stage {boundary} returned a tuple of {len(tensors)} tensors; between 1 and "
                             f"{MAX_TENSORS} can pass between stages")
        return tensors, is_tuple

    def _meta(self, boundary: int):
        if self.declared is not None:
            return ((self.declared, self.dtype),), False
        return self.known[boundary]  # the activation crossed this boundary before its gradient

    def _grad_metas(self, boundary: int):
        return [(shape, dtype) for shape, dtype in self._meta(boundary)[0] if dtype in FLOATING]

    def _send(self, tensor: torch.Tensor, peer: int, batch: P2PBatch | None, alone: bool = False) -> None:
        if batch is None:
            comm.send(tensor, peer, self.group)
        elif alone:
            batch.alone("send", tensor, peer)
        else:
            batch.send(tensor, peer)

    def _recv(self, peer: int, shape, dtype, batch: P2PBatch | None = None) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        if batch is None:
            comm.recv(buf, peer, self.group)
        else:
            batch.recv(buf, peer)
        return buf

    def _check(self, tensor, boundary, shape, dtype, agreed: str, what: str = "activation") -> None:
        got = tuple(tensor.shape)  # dtype None: cast on sending, only the shape must agree
        if got != tuple(shape) or (self.declared is None and dtype is not None and tensor.dtype != dtype):
            hop = f"from virtual stage {boundary} to {boundary + 1}" if what == "activation" else \
                f"from virtual stage {boundary + 1} back to {boundary}"
            raise ValueError(f"pipeline {what} {hop} has shape {got} "
                             f"{tensor.dtype}, but the {agreed} is {tuple(shape)}{'' if dtype is None else f' {dtype}'}; "
                             f"every micro-batch "
                             f"must give the same shape between stages")


def _describe(items, is_tuple: bool) -> str:
    if not is_tuple:
        return "one tensor"
    return f"a tuple of {len(items)}"


def _encode(metas, is_tuple: bool, device) -> torch.Tensor:
    """[count, is_tuple, then per tensor: ndim, dtype code, *shape, 0 ...]: 2 + MAX_TENSORS·ENTRY int64s."""
    out = [len(metas), int(is_tuple)]
    for shape, dtype in metas:
        if len(shape) > MAX_DIMS:
            raise ValueError(f"pipeline activations have at most {MAX_DIMS} dims, got shape {tuple(shape)}")
        if dtype not in DTYPES:
            raise ValueError(f"pipeline activations of dtype {dtype} cannot pass between stages (valid: "
                             f"{', '.join(str(d) for d in DTYPES)}; the floating-point ones carry gradients)")
        out += [len(shape), DTYPES.index(dtype), *shape] + [0] * (MAX_DIMS - len(shape))
    out += [0] * (2 + MAX_TENSORS * ENTRY - len(out))
    return torch.tensor(out, dtype=torch.int64, device=device)


def _decode(meta: torch.Tensor):
    values = meta.tolist()
    count, is_tuple = values[0], bool(values[1])
    metas = []
    for i in range(count):
        entry = values[2 + i * ENTRY:2 + (i + 1) * ENTRY]
        ndim, code = entry[0], entry[1]
        metas.append((tuple(entry[2:2 + ndim]), DTYPES[code]))
    return tuple(metas), is_tuple
