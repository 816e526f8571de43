"""Point-to-point transfers between pipeline stages over the pp group.

Blocking `comm.send`/`comm.recv` of one tensor at a time (never gloo's batched isend/irecv, which
can hang: pytorch#132644). Receive buffers are allocated from shapes known ahead (`act_shape`), so
no metadata travels per message; a schedule that the simulator accepts cannot deadlock with these
rendezvous semantics.
"""
from __future__ import annotations

import torch

from megazero.runtime import comm
from megazero.runtime.comm import GroupHandle


class PipeP2P:
    """Sends and receives activations and their gradients to/from stage `peer` of `pp_group`
    (the group's ranks are ordered by pipeline stage)."""

    def __init__(self, pp_group: GroupHandle, act_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.group, self.shape, self.dtype, self.device = pp_group, tuple(act_shape), dtype, device

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Send an activation or gradient to stage `peer` (blocks until it is received)."""
        if tuple(tensor.shape) != self.shape:
            raise ValueError(f"pipeline send of shape {tuple(tensor.shape)} to stage {peer}, but the "
                             f"activation shape agreed ahead is {self.shape}")
        comm.send(tensor.detach().to(self.dtype).contiguous(), peer, self.group)

    def recv(self, peer: int) -> torch.Tensor:
        """Receive an activation or gradient from stage `peer` into a new buffer."""
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        comm.recv(buf, peer, self.group)
        return buf
