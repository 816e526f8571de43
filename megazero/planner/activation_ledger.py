"""What megazero's layers keep for backward, per micro-batch and model chunk (pure: no torch); program_peaks.py
walks the chunks through a pipeline program.

A chunk's *ledger* lists every storage autograd keeps in a forward, in the order of its first save, each
once (`SavedActivationMeter` counts unique storages: the norm output that q, k and v all save is one),
and marks the recompute regions. Backward releases the storages in reverse order (a storage goes when
its earliest saver's backward has run) and rebuilds a region's tensors when it reaches the region, so
the peak inside a chunk's backward is the largest (bytes still kept + bytes rebuilt) at a region.

Notation: s sequence, b micro-batch, h hidden, a / kv query / KV heads, d = h / a, f ffn, t TP size,
r = t under sequence parallelism (the residual stream, norms and hidden dropouts are sequence shards)
else 1, w bytes of the training dtype, Vp the padded vocabulary; a_t = a/t, kv_t = kv/t, f_t = f/t.
Per transformer block, no recompute (megazero/models/block.py, attention.py):

* each norm: on CPU megazero's reference twin (runtime/kernels/reference.py) computes in fp32 and keeps
  its fp32 input (the input itself when w = 4, else a copy: 4·sbh/r) and 4·sb/r each for mean and rstd
  (LayerNorm; RMSNorm: rstd, and the fp32 normalised x, 4·sbh/r) plus fp32 copies of the weight (and
  bias) when w != 4; on CUDA the fused kernel keeps x itself (w·sbh/r) and fp32 mean (LayerNorm only)
  and rstd. The norm output, w·sbh/r, is kept by the GEMMs after it (under SP their input shard:
  `tensor_parallel.weight_grad.Regather` gathers it again in backward).
* attention: q (w·sbh/t), k and v (w·sb·kv_t·d) are views of their GEMM outputs; RoPE keeps the model's
  cos / sin tables (w·s·d each, one storage per stage for all layers and micro-batches) and makes new
  rotated q, k. SDPA (attention dropout off) keeps q, k, v, its output (w·sbh/t, which the out GEMM
  keeps too) and the fp32 log-sum-exp (4·b·a_t·s; CUDA's memory-efficient kernel, chosen for fp32 or
  a float bias, pads s to a multiple of 32, and keeps ALiBi's (a_t, s, s) bias, w bytes). The reference
  core (dropout on) keeps copies of q, kᵀ and v for its batched GEMMs (w·sbh/t each; K / V repeated per
  query head), the fp32 softmax (CPU twin: 4·b·a_t·s², and its s² causal mask; CUDA kernel:
  w·b·a_t·s²), the dropout mask (b·a_t·s²) and the dropped probabilities (w·b·a_t·s²); the out GEMM
  keeps the context's (s, b, a·d) copy (w·sbh/t). On CPU, SDPA with ALiBi's float bias runs its math
  kernel: fp32 copies of q, kᵀ, v (4·sbh/t each) and the fp32 softmax (4·b·a_t·s²), then the context.
* hidden dropouts keep 1-byte masks (sbh/r each); the MLP keeps w·sb·f_t twice (GeLU input and
  output; ReLU: its output once) or four times (SwiGLU: gate, up, silu(gate), their product).
* first chunk: the embedding keeps its local ids (int64, 8·sb), the out-of-range mask (sb) and its
  dropout mask; last chunk: the head's norm, its GEMM input (w·sbh: under SP the all-gathered
  sequence) and the vocabulary-parallel cross-entropy's fp32 softmax 4·sb·Vp/t, int64 targets 8·sb, two
  bool masks 2·sb and the mean's 0-d int64 divisor (8 B). The block input is the previous layer's
  output (or the received activation): w·sbh/r.

* a Mixture-of-Experts MLP: moe_ledger.py (the router's fp32 tensors, the rows gathered, dispatched and
  combined, the experts' intermediates, from moe_plan.py's rows under balanced routing).
* context parallelism (cp ranks): every token-wise tensor above is s/cp long (s below is this rank's s/cp
  tokens); the attention's RoPE tables, core and out-GEMM input are cp_ledger.py's (ring or Ulysses).

Recompute: ``full`` keeps each block's input (w·sbh/r) and rebuilds everything else the block keeps
(including the RoPE tables); ``selective`` keeps q, k, v for the attention core and rebuilds the core's
tensors (`ActivationCheckpointer.attention_core`). The rebuilt inputs are what
`activation_checkpoint.storage.CheckpointStore.load` returns: ``x.reshape(-1)[:n].view(shape)``, a
contiguous copy of q, k and v (permuted views of their GEMM outputs, unless b = 1 and one local head),
so the selective working set holds them again besides the kept originals.
"""
from __future__ import annotations

from dataclasses import dataclass

from megazero.core.partition import segment_sizes
from megazero.planner.cp_ledger import core_working, cp_attention
from megazero.planner.moe_ledger import intermediates, moe_saves
from megazero.planner.moe_plan import MoEShape, moe_shape
from megazero.planner.working_sets import backward_working, pending_wgrad


@dataclass(frozen=True)
class Chunk:
    """One micro-batch of one model chunk: `saved` bytes kept after its forward, `backward_peak` the most
    alive during its backward (kept + rebuilt, >= saved), `shared` per-stage storages {name: bytes}
    (RoPE tables), `logits` bytes alive beyond the kept ones while the loss runs (head chunk), `wgrad`
    bytes zero bubble's B leaves for W, `working` what its backward holds at its last block's first GEMM
    beyond the chunk's `first_backward` bytes then alive (`backward_working`; `working_wgrad` of it the
    weight gradient, which zero bubble's B leaves to W); `core` what a context-parallel attention core's backward
    holds beyond the chunk's `first_backward` bytes, its last block's MLP tensors released by then (cp_ledger.py)."""

    saved: int
    backward_peak: int
    shared: dict
    logits: int = 0
    wgrad: int = 0
    saved_host: int = 0
    working: int = 0
    working_wgrad: int = 0
    first_backward: int = 0
    core: int = 0


class _Ledger:
    """One chunk's kept storages in forward order (each name once), its recompute regions and its
    per-stage shared storages."""

    def __init__(self):
        self.items: list = []  # ("save", bytes) | ("region", rebuilt bytes)
        self.names: set = set()
        self.shared: dict = {}
        self.host = 0  # bytes kept in host memory (CPU checkpoints), beside the device items

    def save(self, name: str, nbytes: int) -> None:
        if name not in self.names:
            self.names.add(name)
            self.items.append(("save", nbytes))

    def save_host(self, name: str, nbytes: int) -> None:
        if name not in self.names:
            self.names.add(name)
            self.host += nbytes

    def share(self, name: str, nbytes: int) -> None:
        self.shared[name] = nbytes

    def region(self, rebuilt: int) -> None:
        self.items.append(("region", rebuilt))

    def mark(self) -> None:
        """The end of the chunk's last block (the head's tensors follow)."""
        self.items.append(("mark", 0))

    @property
    def saved(self) -> int:
        return sum(n for kind, n in self.items if kind == "save")

    def backward_peak(self) -> int:
        alive = peak = self.saved
        for kind, n in reversed(self.items):
            if kind == "save":
                alive -= n
            elif kind == "region":
                peak = max(peak, alive + n)
        return peak

    def first_block_backward(self) -> int:
        """Bytes of the chunk alive when its last block's backward starts: the head's tensors already released,
        the last full-recompute segment rebuilt (the region right before the `mark`); all of them without one."""
        alive = self.saved
        items = self.items
        for i in range(len(items) - 1, -1, -1):
            kind, n = items[i]
            if kind == "mark":
                return alive + (items[i - 1][1] if i and items[i - 1][0] == "region" else 0)
            if kind == "save":
                alive -= n
        return self.saved


@dataclass(frozen=True)
class _Dims:
    """The sizes and switches the ledger reads (see the module docstring's notation)."""

    s: int
    b: int
    h: int
    a_t: int
    kv_t: int
    d: int
    f_t: int
    r: int
    w: int
    cuda: bool
    layernorm: bool
    activation: str
    rope: bool
    alibi: bool
    hidden_dropout: bool
    attention_dropout: bool
    vocab_t: int
    embedding_norm: bool
    moe: MoEShape | None = None
    cp: int = 1  # context parallel ranks; s is then this rank's seq / cp tokens
    cp_method: str = "ring"
    seq: int = 0  # the whole sequence

    @property
    def rows(self) -> int:
        return self.s * self.b // self.r

    @property
    def stream(self) -> int:  # bytes of the residual stream (s/r, b, h)
        return self.rows * self.h * self.w

    @property
    def q_bytes(self) -> int:  # (s, b, a_t·d)
        return self.s * self.b * self.a_t * self.d * self.w

    @property
    def kv_bytes(self) -> int:  # (s, b, kv_t·d)
        return self.s * self.b * self.kv_t * self.d * self.w

    @property
    def scores(self) -> int:  # elements of (b, a_t, s, s)
        return self.b * self.a_t * self.s * self.s


def dims(spec, layout, device: str) -> _Dims:
    t, cp = layout.tp, layout.cp
    return _Dims(s=spec.seq_len // cp, b=layout.micro_batch, h=spec.hidden, a_t=spec.heads // t,
                 kv_t=spec.num_kv_heads // t, d=spec.head_dim, f_t=spec.ffn // t,
                 r=t if layout.sequence_parallel and t > 1 else 1,
                 w={"bf16": 2, "fp16": 2, "fp32": 4}[layout.precision], cuda=device != "cpu",
                 layernorm=spec.norm == "layernorm", activation=spec.activation, rope=spec.position == "rope",
                 alibi=spec.position == "alibi", hidden_dropout=spec.dropout > 0,
                 attention_dropout=spec.attention_dropout > 0, vocab_t=spec.padded_vocab(t) // t,
                 embedding_norm=spec.embedding_norm, moe=moe_shape(spec, layout), cp=cp,
                 cp_method=layout.cp_method, seq=spec.seq_len)


def _norm(L: _Ledger, c: _Dims, p: str, x: str) -> None:
    """The tensors one norm keeps (see the module docstring); `x` names its input's storage."""
    n, stat = c.rows * c.h, c.rows * 4
    if c.cuda:  # megazero_cuda norm_fwd: x, fp32 mean (LayerNorm) and rstd
        L.save(x, n * c.w)
        if c.layernorm:
            L.save(p + ".mean", stat)
        L.save(p + ".rstd", stat)
        return
    xf = x if c.w == 4 else p + ".x32"  # x.to(fp32): the input itself in fp32, else a copy
    L.save(xf, n * 4)
    if c.w != 4:  # weight.to(fp32) (and bias): copies, kept by the fp32 op (parameters are not counted)
        L.save(p + ".w32", c.h * 4)
        if c.layernorm:
            L.save(p + ".b32", c.h * 4)
    if c.layernorm:  # F.layer_norm keeps input, mean, rstd
        L.save(p + ".mean", stat)
    L.save(p + ".rstd", stat)
    if not c.layernorm:  # RMSNorm: (xf * rstd) is kept by the weight multiply
        L.save(p + ".normed", n * 4)


def _contiguous(c: _Dims, heads: int) -> bool:
    """Whether a (b, heads, s, d) permuted view of an (s, b, heads·d) GEMM output is contiguous."""
    return c.s == 1 or (c.b == 1 and heads == 1)


def _explicit_core(L: _Ledger, c: _Dims, p: str, rebuilt: bool) -> int:
    """The tensors of an attention core that materialises the scores, into `L`; returns their bytes.
    SelfAttention.reference_core (attention dropout on), or SDPA's math kernel, which CPU runs for
    ALiBi's float bias and which computes 16-bit inputs in fp32 (copies of q, kᵀ, v and the softmax
    in fp32). The batched GEMMs keep contiguous copies of q, kᵀ and v (K / V repeated per query head
    under GQA), or views when the input already is contiguous: `rebuilt` (the recompute's loaded
    copies) counts those only when they are new storages."""
    math = not c.attention_dropout
    el = 4 if math else c.w
    a_size = c.s * c.b * c.a_t * c.d

    def kept(heads: int, repeated: bool) -> int:
        new = not rebuilt or repeated or (math and c.w != 4) or not _contiguous(c, heads)
        return a_size * el if new else 0

    gqa = c.kv_t != c.a_t
    if math:  # softmax in fp32; its output is the probabilities the second GEMM keeps (same storage)
        scores = [(p + ".softmax", c.scores * 4)]
    else:  # the fused kernel keeps y in the scores' dtype; the twin fp32 and its (s, s) causal mask
        scores = [(p + ".causal", 0 if c.cuda else c.s * c.s), (p + ".softmax", c.scores * (c.w if c.cuda else 4)),
                  (p + ".pmask", c.scores), (p + ".probs", c.scores * c.w)]  # dropout mask, dropped probabilities
    parts = [(p + ".qc", kept(c.a_t, False)), (p + ".kt", kept(c.kv_t, gqa)), (p + ".vc", kept(c.kv_t, gqa))]
    for name, n in parts + scores:
        if n:
            L.save(name, n)
    return sum(n for _, n in parts + scores)


def _fused_extras(c: _Dims, p: str) -> list[tuple[str, int]]:
    """What a fused SDPA kernel keeps besides q, k, v: its output and the fp32 log-sum-exp (CPU flash and
    CUDA flash: (b, a_t, s); CUDA's memory-efficient kernel, which fp32 and a float bias select, pads
    s to a multiple of 32) and, for ALiBi on CUDA, the (a_t, s, s) bias of this call."""
    efficient = c.cuda and (c.w == 4 or c.alibi)
    rows = -(-c.s // 32) * 32 if efficient else c.s
    out = [(p + ".o", c.q_bytes), (p + ".lse", c.b * c.a_t * rows * 4)]
    return out + ([(p + ".bias", c.a_t * c.s * c.s * c.w)] if c.alibi and c.cuda else [])


def _attention(L: _Ledger, c: _Dims, p: str, policy: str) -> None:
    """q, k, v, RoPE and the core; then the out GEMM's input."""
    qn, kn, vn = p + ".q", p + ".k", p + ".v"  # views of the q / k / v GEMM outputs
    if c.cp > 1:  # RoPE at this rank's positions, the ring or Ulysses core (cp_ledger.py)
        qkv = ((p + ".qr", c.q_bytes, c.a_t), (p + ".kr", c.kv_bytes, c.kv_t)) if c.rope else \
              ((qn, c.q_bytes, c.a_t), (kn, c.kv_bytes, c.kv_t))
        qkv += ((vn, c.kv_bytes, c.kv_t),)
        copies = sum(n for _, n, heads in qkv if not _contiguous(c, heads))
        cp_attention(L, c, p, policy, [(name, n) for name, n, _ in qkv], copies, _fused_extras, _explicit_core,
                     _Ledger)
        return
    if c.rope:  # apply_rope keeps cos and sin (one storage each per stage); rotated q, k are new tensors
        L.share("rope.cos", c.s * c.d * c.w)
        L.share("rope.sin", c.s * c.d * c.w)
        qn, kn = p + ".qr", p + ".kr"
    fused = not c.attention_dropout and not (c.alibi and not c.cuda)
    qkv = ((qn, c.q_bytes, c.a_t), (kn, c.kv_bytes, c.kv_t), (vn, c.kv_bytes, c.kv_t))
    if policy == "selective":  # the region's Anchor keeps q, k, v; the core is rebuilt in backward
        for name, n, _ in qkv:
            L.save(name, n)
        if fused:  # SDPA on the loaded copies: q', k', v' (new unless contiguous), and its extras
            copies = sum(n for _, n, heads in qkv if not _contiguous(c, heads))
            L.region(copies + sum(n for _, n in _fused_extras(c, p)))
        else:
            L.region(_explicit_core(_Ledger(), c, p, rebuilt=True))
    elif fused:
        for name, n in [(name, n) for name, n, _ in qkv] + _fused_extras(c, p):
            L.save(name, n)
    else:
        _explicit_core(L, c, p, rebuilt=False)
    # the out GEMM's input: SDPA's output itself (its (s, b, a·d) rearrangement is a view), or the
    # explicit core's context rearranged (a copy, in the training dtype)
    L.save(p + ".o" if fused else p + ".ctx", c.q_bytes)


def block(L: _Ledger, c: _Dims, p: str, x: str, policy: str) -> str:
    """One TransformerBlock's kept tensors under `policy`; `x` names its input. Returns its output's name."""
    out = p + ".out"
    if policy == "full":  # the Anchor keeps x; the recompute rebuilds all the rest (RoPE tables included)
        inner = _Ledger()
        block(inner, c, p, x, "none")
        L.save(x, c.stream)
        L.region(inner.saved + sum(inner.shared.values()) - (c.stream if x in inner.names else 0))
        return out
    _norm(L, c, p + ".n1", x)
    L.save(p + ".xn", c.stream)  # kept by the q, k, v GEMMs
    _attention(L, c, p, policy)
    if c.hidden_dropout:
        L.save(p + ".drop1", c.rows * c.h)
    _norm(L, c, p + ".n2", p + ".mid")  # the residual x + attn(x)
    if c.moe is not None:
        moe_saves(L, c, p)
    else:
        L.save(p + ".xn2", c.stream)
        inner = c.s * c.b * c.f_t * c.w
        for i in range(intermediates(c.activation)):
            L.save(f"{p}.mlp{i}", inner)
    if c.hidden_dropout:
        L.save(p + ".drop2", c.rows * c.h)
    return out


def segment(L: _Ledger, c: _Dims, units: list[int], x: str, layout) -> str:
    """One full-policy checkpoint segment of blocks `units` (`megazero.activation_checkpoint`): its kept
    input in the `CheckpointStore` form the layout's options give, and the region that rebuilds every
    block's tensors. Kept forms: plain, the input itself (w·sbh/r, the previous layer's output);
    partitioned, this TP rank's ceil(sbh/t) elements; CPU, a host copy; contiguous, a slot of the stage's
    buffer (counted once per stage, `checkpoint_pool`). The recompute's input is the kept storage again
    (plain; a CPU copy or a pool slot already where the model computes) or a new one (the all-gathered
    t·ceil(sbh/t) elements; a host copy brought to the accelerator), counted when a rebuilt layer keeps it."""
    inner, y = _Ledger(), x
    for u in units:
        y = block(inner, c, f"u{u}", y, "none")
    numel = c.rows * c.h
    t = layout.tp
    kept = -(-numel // t) if layout.partition_activations else numel
    reused = x in inner.names  # a rebuilt layer keeps the recompute's input
    if layout.contiguous_checkpoints:
        pass  # the stage's buffer, counted once (checkpoint_pool); the slot is a view of it
    elif layout.cpu_checkpointing:
        L.save_host(f"{x}.kept", kept * c.w)
    elif layout.partition_activations:
        L.save(f"{x}.kept", kept * c.w)
    else:
        L.save(x, c.stream)
    loaded = 0  # a new storage for the recompute's input (else: the kept one, already counted)
    if layout.partition_activations:
        loaded = t * kept * c.w
    elif layout.cpu_checkpointing and c.cuda:
        loaded = numel * c.w
    rebuilt = inner.saved + sum(inner.shared.values()) - (c.stream if reused else 0) + (loaded if reused else 0)
    L.region(rebuilt)
    return y


def checkpoint_pool(spec, layout, chunks, in_flight: int) -> int:
    """Bytes of a stage's contiguous checkpoint buffer (``contiguous_memory_optimization``;
    `ActivationCheckpointer._size_pool`): (the most segments of a chunk) x (micro-batch chunks in flight on
    the stage) slots of one kept input each; 0 without it."""
    if not (layout.contiguous_checkpoints and layout.recompute == "full"):
        return 0
    c = dims(spec, layout, "cuda")
    blocks = [sum(kind == "block" for kind, _ in chunk) for chunk in chunks]
    per_chunk = [len(segment_sizes(n, layout.every_k_layers, layout.number_checkpoints)) if n else 0 for n in blocks]
    numel = c.rows * c.h
    kept = -(-numel // layout.tp) if layout.partition_activations else numel
    return max(1, max(per_chunk, default=1) * max(1, in_flight)) * kept * c.w


def _embedding(L: _Ledger, c: _Dims) -> str:
    L.save("emb.ids", c.s * c.b * 8)  # F.embedding: the local ids, int64 (s, b)
    L.save("emb.outside", c.s * c.b)  # masked_fill: the out-of-range mask (s, b, 1) bool
    if c.cp > 1 and not (c.rope or c.alibi):  # learned positions at this rank's positions: the index (int64)
        L.save("emb.positions", c.s * 8)
    if c.embedding_norm:
        _norm(L, c, "emb.n", "emb.sum")
    if c.hidden_dropout:
        L.save("emb.drop", c.rows * c.h)
    return "emb.out"


def _head(L: _Ledger, c: _Dims, x: str) -> int:
    """The head and the loss; returns the bytes alive beyond them while the loss runs: the logits
    (w per element) and the fp32 shifted logits next to the kept exp (megazero/tensor_parallel/
    cross_entropy.py), over s·b·Vp/t elements."""
    _norm(L, c, "head.n", x)
    L.save("head.xn", c.s * c.b * c.h * c.w)  # the GEMM input: the norm output, all-gathered under SP
    tokens = c.s * c.b
    for name, n in (("ce.softmax", tokens * c.vocab_t * 4), ("ce.target", tokens * 8), ("ce.mine", tokens),
                    ("ce.ignored", tokens), ("ce.divisor", 8)):
        L.save(name, n)
    return tokens * c.vocab_t * (c.w + 4)


def activation_chunks(spec, layout, chunks, device: str, param_counts: dict) -> list[Chunk]:
    """One `Chunk` per model chunk of a stage (`chunks`: [[(kind, unit)]], see stages.pipeline_layers;
    `param_counts`: {kind: (elements of its parameters whose weight GEMMs zero bubble does not defer:
    vectors and an MoE MLP's, of all its parameters)} on one rank)."""
    c = dims(spec, layout, device)
    policy = layout.recompute
    out = []
    for chunk in chunks:
        L, x, logits, wgrad = _Ledger(), "chunk.in", 0, 0
        blocks = [unit for kind, unit in chunk if kind == "block"]
        sizes = segment_sizes(len(blocks), layout.every_k_layers, layout.number_checkpoints) if blocks else []
        starts = {blocks[sum(sizes[:i])]: blocks[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(sizes))}
        for kind, unit in chunk:
            wgrad += pending_wgrad(c, kind, *param_counts[kind])
            if kind == "embedding":
                x = _embedding(L, c)
            elif kind == "block" and policy == "full":
                if unit in starts:  # the segment's first block: the segment as a whole
                    x = segment(L, c, starts[unit], x, layout)
            elif kind == "block":
                x = block(L, c, f"u{unit}", x, policy)
            else:
                if blocks:
                    L.mark()
                logits = _head(L, c, x)
        working = backward_working(c) if blocks else (0, 0)
        out.append(Chunk(L.saved, L.backward_peak(), dict(L.shared), logits, wgrad, L.host, *working,
                         L.first_block_backward(), _core_transient(c, policy) if blocks else 0))
    return out


def _core_transient(c: _Dims, policy: str) -> int:
    """`Chunk.core`: a context-parallel core's backward working set (`cp_ledger.core_working`), with the core's
    tensors a selective recompute rebuilt, less the last block's MLP tensors (its second norm's, the MLP's
    input and intermediates), released before its attention's backward; 0 without context parallelism."""
    if c.cp == 1:
        return 0
    mlp = _Ledger()
    _norm(mlp, c, "n2", "mid")
    mlp.save("xn2", c.stream)
    for i in range(intermediates(c.activation)):
        mlp.save(f"mlp{i}", c.s * c.b * c.f_t * c.w)
    attn = _Ledger()
    _attention(attn, c, "u", policy)
    rebuilt = sum(n for kind, n in attn.items if kind == "region")
    return max(0, core_working(c) + rebuilt - mlp.saved)


def layer_bytes(spec, layout, device: str = "cuda") -> dict[str, int]:
    """Bytes one micro-batch keeps after its forward, per layer kind on one TP rank: ``block`` (a block
    inside a chunk, its input counted), ``embedding``, ``head`` (with the loss), and ``shared`` (per-stage
    storages: the RoPE tables). Recompute regions count what they keep, not what they rebuild."""
    c = dims(spec, layout, device)
    blk, emb, head = _Ledger(), _Ledger(), _Ledger()
    block(blk, c, "u1", "u0.out", layout.recompute)
    _embedding(emb, c)
    _head(head, c, "u0.out")
    return {"block": blk.saved, "embedding": emb.saved, "head": head.saved, "shared": sum(blk.shared.values())}
