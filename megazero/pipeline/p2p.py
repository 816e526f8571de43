"""Point-to-point transfers between pipeline stages over the pp group.

Blocking `comm.send`/`comm.recv` of one tensor at a time (never gloo's batched isend/irecv, which
can hang: pytorch#132644); a schedule that the simulator accepts cannot deadlock with these
rendezvous semantics.

Receive buffers need a shape and dtype. Each *boundary* between virtual stages v and v + 1 carries
the activations of v (downstream) and their gradients (upstream, same shape and dtype). Either:

- the shape is declared ahead (`act_shape`, e.g. a model spec's (s, b, h)): every boundary carries
  it in `dtype`, and no metadata ever travels; or
- it is learned on the first micro-batch (a user's `PipelineModule` that declares nothing): the
  first activation sent across a boundary is preceded by one small int64 message with its shape and
  dtype; both ends cache it. A later activation of another shape or dtype is an error that names
  the stage, the boundary and both shapes, raised on the sending stage before anything is sent.
"""
from __future__ import annotations

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle

MAX_DIMS = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # the code of a dtype is its index here


class PipeP2P:
    """Sends and receives activations and their gradients to/from stage `peer` of `pp_group`
    (the group's ranks are ordered by pipeline stage); `stage` is this rank's stage.

    Args:
        act_shape: the shape of every activation between stages, or None to learn each boundary's
            shape and dtype from its first activation.
        dtype: the dtype activations travel in when `act_shape` is given (the compute dtype).
    """

    def __init__(self, pp_group: GroupHandle, act_shape: tuple[int, ...] | None, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.group, self.dtype, self.device = pp_group, dtype, device
        self.declared = tuple(act_shape) if act_shape is not None else None
        self.known: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}  # boundary -> (shape, dtype)

    # -- activations (downstream) -----------------------------------------------------------------
    def send_activation(self, tensor: torch.Tensor, peer: int, boundary: int) -> None:
        """Send the activation crossing `boundary` (virtual stage `boundary` -> `boundary + 1`) to stage
        `peer`; the first one across an undeclared boundary is preceded by its shape and dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"virtual stage {boundary} returned a {type(tensor).__name__}; the output a pipeline "
                            f"stage passes on must be one tensor (pack several into one, or keep them in one stage)")
        if self.declared is not None:
            self._check(tensor, boundary, self.declared, self.dtype, "declared activation shape")
            comm.send(tensor.detach().to(self.dtype).contiguous(), peer, self.group)
            return
        if boundary not in self.known:
            meta = _encode(tensor.shape, tensor.dtype, self.device)  # refuses what cannot travel, before caching
            self.known[boundary] = (tuple(tensor.shape), tensor.dtype)
            comm.send(meta, peer, self.group)
        else:
            shape, dtype = self.known[boundary]
            self._check(tensor, boundary, shape, dtype, "first micro-batch's activation")
        comm.send(tensor.detach().contiguous(), peer, self.group)

    def recv_activation(self, peer: int, boundary: int) -> torch.Tensor:
        """Receive the activation crossing `boundary` from stage `peer` into a new buffer."""
        if self.declared is None and boundary not in self.known:
            meta = torch.empty(MAX_DIMS + 2, dtype=torch.int64, device=self.device)
            comm.recv(meta, peer, self.group)
            self.known[boundary] = _decode(meta)
        return self._recv(peer, boundary)

    # -- gradients (upstream) ---------------------------------------------------------------------
    def send_grad(self, tensor: torch.Tensor, peer: int, boundary: int) -> None:
        """Send the gradient of the activation that crossed `boundary` back to stage `peer`."""
        shape, dtype = self._meta(boundary)
        self._check(tensor, boundary, shape, None, "activation's shape", what="gradient")
        comm.send(tensor.detach().to(dtype).contiguous(), peer, self.group)

    def recv_grad(self, peer: int, boundary: int) -> torch.Tensor:
        """Receive the gradient of the activation this stage sent across `boundary`."""
        return self._recv(peer, boundary)

    # -- helpers ----------------------------------------------------------------------------------
    def _meta(self, boundary: int) -> tuple[tuple[int, ...], torch.dtype]:
        if self.declared is not None:
            return self.declared, self.dtype
        return self.known[boundary]  # the activation crossed this boundary before its gradient

    def _recv(self, peer: int, boundary: int) -> torch.Tensor:
        shape, dtype = self._meta(boundary)
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        comm.recv(buf, peer, self.group)
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


def _encode(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """[ndim, dtype code, *shape, 0 ...]: MAX_DIMS + 2 int64s."""
    if len(shape) > MAX_DIMS:
        raise ValueError(f"pipeline activations have at most {MAX_DIMS} dims, got shape {tuple(shape)}")
    if dtype not in DTYPES:
        raise ValueError(f"pipeline activations of dtype {dtype} cannot carry gradients between stages; a stage "
                         f"passes on a floating-point tensor ({', '.join(str(d) for d in DTYPES)})")
    meta = [len(shape), DTYPES.index(dtype), *shape] + [0] * (MAX_DIMS - len(shape))
    return torch.tensor(meta, dtype=torch.int64, device=device)


def _decode(meta: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    values = meta.tolist()
    ndim, code = values[0], values[1]
    return tuple(values[2:2 + ndim]), DTYPES[code]
