"""What a chunk's backward holds beyond the tensors its layers kept (pure: no torch), for activation_ledger.py's
`Chunk` (same notation: s this rank's tokens, b, h, f_t, w, r = t under sequence parallelism; `c` is an
activation_ledger._Dims): the working set of its last block's first backward GEMM (`backward_working`) and what
zero bubble's B leaves for W (`pending_wgrad`). A context-parallel attention core's: cp_ledger.core_working."""
from __future__ import annotations


def backward_working(c) -> tuple[int, int]:
    """(bytes, of them the weight gradient's) a block's backward holds beyond the tensors kept for it, at its
    first GEMM, the MLP's output projection (every tensor its blocks kept still alive; the head's are gone):
    the incoming gradient of the stream (w·sbh/r), under SP its all-gather (w·sbh, RowParallelLinear's
    backward), without SP the hidden dropout's new gradient (w·sbh), the projection's input gradient
    (w·sb·f_t) and its weight gradient (w·h·f_t, a new tensor until autograd accumulates it; zero bubble
    defers it to W). An MoE MLP's expert backward is not counted (0)."""
    if c.moe is not None:
        return 0, 0
    gathered = c.s * c.b * c.h * c.w if c.r > 1 else 0
    dropped = c.stream if c.hidden_dropout and c.r == 1 else 0  # the dropout's backward: a new gradient
    weight = c.h * c.f_t * c.w
    return c.stream + gathered + dropped + c.s * c.b * c.f_t * c.w + weight, weight


def pending_wgrad(c, kind: str, other_params: int, all_params: int) -> int:
    """Bytes zero bubble's B leaves for W (tensor_parallel/weight_grad.py, pipeline/executor.py): each
    deferred GEMM's (input, output gradient), the region input once (under SP the re-gathered (s, b, h)),
    and the gradients of the other parameters B computed (`other_params`: vectors, and an MoE MLP's,
    whose GEMMs are not deferred; the head's GEMM is not deferred)."""
    if kind != "block":
        return all_params * c.w
    full, inner = c.s * c.b * c.h * c.w, c.s * c.b * c.f_t * c.w
    attn = full + (c.q_bytes + 2 * c.kv_bytes) + (c.q_bytes + full)  # q/k/v: x once, three grads; out
    if c.moe is not None:
        mlp = 0
    elif c.activation == "swiglu":
        mlp = full + 2 * inner + (inner + full)
    else:
        mlp = full + inner + (inner + full)
    return attn + mlp + other_params * c.w
