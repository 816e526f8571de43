"""The parameters of one pipeline layer of a spec model on one TP rank, as megazero's layers register them
(pure: no torch). memory_plan.py lays them out in the ZeRO flat groups; stages.py counts them for the
``parameters`` partition; `megazero.toolbox.model_facts` checks them against the layers built on meta."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from megazero.planner.moe_plan import moe_shape


@dataclass(frozen=True)
class Param:
    """One parameter of a layer on one TP rank: numel, whether it is a matrix (Megatron's weight-decay
    split puts matrices first), whether it is the tied word embedding / LM head weight, and which part
    of an MoE MLP it is ("router", "expert": the routed experts, "shared"; "" for the rest)."""

    numel: int
    matrix: bool
    tied: bool = False
    moe: str = ""

    @property
    def expert(self) -> bool:
        """A routed expert: split over ep, in the experts' flat group."""
        return self.moe == "expert"


def _moe_mlp(spec, layout) -> list[Param]:
    """An MoE MLP's parameters on one rank (megazero/moe/layer.py, experts.py: the router, then the routed
    experts' stacked gate, up (or fc1), each followed by its bias (E / ep, f / t_e) when the spec has
    biases, and down (or fc2) and its replicated bias (E / ep, h); then the shared experts' alike)."""
    m = moe_shape(spec, layout)

    def experts(local: int, width: int, part: str) -> list[Param]:
        out = []
        for i in range(m.mats):
            out.append(Param(local * width * m.hidden, True, moe=part))
            if spec.bias:  # zero-initialised, no weight decay (Megatron's vectors)
                out.append(Param(local * (m.hidden if i == m.mats - 1 else width), False, moe=part))
        return out

    shared = experts(1, m.shared, "shared") if m.shared else []
    return [Param(m.num_experts * m.hidden, True, moe="router")] + experts(m.local, m.ffn, "expert") + shared


def layer_params(spec, kind: str, t: int, layout=None) -> list[Param]:
    """The parameters of one layer (`kind` embedding | block | head) of `spec` on one of `t` TP ranks, in
    registration order (megazero/models/embedding.py, block.py, attention.py, common.py:Norm); an MoE
    block's MLP as on a rank of `layout` (its ep and expert_tp; None: ep 1, experts split over t)."""
    h, ln, tied = spec.hidden, spec.norm == "layernorm", spec.tie_embeddings
    vocab = spec.padded_vocab(t) // t  # VocabParallelEmbedding / HeadLayer rows on this rank

    def norm():
        return [Param(h, False)] + ([Param(h, False)] if ln else [])

    def linear(n_out, n_in, bias_numel):
        return [Param(n_out * n_in, True)] + ([Param(bias_numel, False)] if spec.bias else [])

    if kind == "embedding":  # the module's own position table first, then its submodules' (nn.Module order)
        out = [Param(spec.seq_len * h, True)] if spec.position == "learned" else []
        return out + [Param(vocab * h, True, tied)] + (norm() if spec.embedding_norm else [])
    if kind == "head":
        return norm() + [Param(vocab * h, True, tied)]
    q, kv, f = spec.heads * spec.head_dim // t, spec.num_kv_heads * spec.head_dim // t, spec.ffn // t
    attn = linear(q, h, q) + linear(kv, h, kv) + linear(kv, h, kv) + linear(h, q, h)  # out's bias: replicated
    if spec.moe is not None:
        # without a layout: ep 1, experts split over the t ranks (the parameters depend only on ep and etp;
        # moe_shape reads these five fields)
        ranks = layout if layout is not None else SimpleNamespace(micro_batch=1, ep=1, moe_imbalance=1.0, etp=t, cp=1)
        mlp = _moe_mlp(spec, ranks)
    elif spec.activation == "swiglu":
        mlp = linear(f, h, f) + linear(f, h, f) + linear(h, f, h)
    else:
        mlp = linear(f, h, f) + linear(h, f, h)
    return norm() + attn + norm() + mlp
