"""Context parallelism's attention (megazero/context_parallel): ring and Ulysses against attention over the whole
sequence in one process, forward and backward, on gloo ranks; and the token layout."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from megazero.context_parallel import token_layout as layout
from tests.harness import run_ranks


def test_layout_gives_each_rank_a_head_and_a_tail_chunk():
    assert layout.positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert layout.positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    for seq, cp in [(8, 1), (16, 2), (24, 3), (32, 4), (64, 8)]:
        held = torch.cat([layout.positions(seq, r, cp) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(seq))  # every token once
        # causal work (keys at or before each query) is the same on every rank
        work = {int((layout.positions(seq, r, cp) + 1).sum()) for r in range(cp)}
        assert len(work) == 1, (seq, cp, work)
        t = torch.arange(seq).view(1, seq).expand(2, seq)
        assert all(torch.equal(layout.take(t, 1, r, cp)[0], layout.positions(seq, r, cp)) for r in range(cp))
        assert torch.equal(layout.gathered_order(seq, cp)[layout.natural_order(seq, cp)], torch.arange(seq))
    with pytest.raises(ValueError, match="model.seq_len=20.*2\\*cp=8"):
        layout.positions(20, 0, 4)


def reference_attention(q, k, v, docs=None, slopes=None):
    """The whole sequence in one process: explicit scores in fp64, causal (+ documents, + ALiBi)."""
    b, h, s, d = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(d)
    pos = torch.arange(s)
    allowed = (pos.view(1, s) <= pos.view(s, 1)).expand(b, s, s)
    if docs is not None:
        allowed = allowed & (docs.unsqueeze(1) == docs.unsqueeze(2))
    if slopes is not None:
        scores = scores + slopes.double().view(1, h, 1, 1) * (pos.view(1, s) - pos.view(s, 1)).double()
    scores = scores.masked_fill(~allowed.unsqueeze(1), -math.inf)
    return (scores.softmax(-1) @ v.double()).float()


def _cp_rank(method, b, heads, kv, seq, d, with_docs, with_alibi, seed=0):
    from megazero.context_parallel.ring import ring_attention
    from megazero.context_parallel.ulysses import ulysses_attention
    from megazero.core.topology import Topology
    from megazero.runtime.parallel_context import ParallelContext
    import torch.distributed as dist

    cp = dist.get_world_size()
    pctx = ParallelContext(Topology(cp=cp))
    group = pctx.cp_group
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, seq, d, generator=gen) for n in (heads, kv, kv))
    dout = torch.randn(b, heads, seq, d, generator=gen)
    docs = torch.randint(0, 3, (b, seq), generator=gen).sort(dim=1).values if with_docs else None
    slopes = torch.rand(heads, generator=gen) if with_alibi else None
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*full, docs, slopes)
    ref.backward(dout)
    r = group.rank
    mine = [layout.take(x, 2, r, cp).detach().clone().requires_grad_() for x in (q, k, v)]
    fn = ring_attention if method == "ring" else ulysses_attention
    out = fn(*mine, group, seq, docs=docs, slopes=slopes)
    out.backward(layout.take(dout, 2, r, cp))
    errs = {"out": (out - layout.take(ref, 2, r, cp)).abs().max().item()}
    for name, x, full_x in zip("qkv", mine, full, strict=True):
        errs["d" + name] = (x.grad - layout.take(full_x.grad, 2, r, cp)).abs().max().item()
    moved = pctx.stats.snapshot()
    pctx.destroy()
    return errs, moved


CASES = [  # (cp, method, heads, kv, docs, alibi): both methods at cp 2 and 4, GQA, documents and ALiBi each (the
    # ring's plain causal pairs run torch's fused CPU kernel, those with documents or ALiBi plain PyTorch)
    (cp, method, heads, kv, docs, alibi)
    for cp, method in itertools.product((2, 4), ("ring", "ulysses"))
    for heads, kv, docs, alibi in [(4, 4, False, False), (8, 2, False, False), (4, 2, True, False), (8, 2, False, True),
                                   (4, 1, True, True)]
]


@pytest.mark.parametrize("cp,method,heads,kv,docs,alibi", CASES)
def test_cp_attention_equals_whole_sequence_attention(cp, method, heads, kv, docs, alibi):
    """Outputs and the gradients of q, k and v of every rank's tokens equal those of attention over the whole
    sequence (fp64 reference) within fp32 rounding."""
    b, seq, d = 2, 8 * cp, 8
    results = run_ranks(_cp_rank, cp, method, b, heads, kv, seq, d, docs, alibi)
    for errs, _ in results:
        # fp32 absolute errors of O(1) outputs and gradients: the cp ranks' online softmax sums the keys in blocks, another order (~100 ulps)
        assert max(errs.values()) < 2e-5, errs


def test_ring_bytes_equal_the_formula():
    """Ring, cp 4, b 2, kv 2, seq 32, d 8: per rank forward 3 key/value blocks (2·b·kv·(s/cp)·d fp32 each) and
    backward 3 blocks plus 4 dK/dV partials (fp32), sent and received."""
    cp, b, kv, seq, d = 4, 2, 2, 32, 8
    block = 2 * b * kv * (seq // cp) * d * 4
    for _, moved in run_ranks(_cp_rank, cp, "ring", b, 4, kv, seq, d, False, False):
        assert moved["cp/send"]["bytes"] == moved["cp/recv"]["bytes"] == (cp - 1) * block * 2 + cp * block
        assert moved["cp/send"]["calls"] == 2 * (cp - 1) + cp


def _ring_events(delay_s):
    """cp 2 ring forward and backward with comm instrumented: this rank's events in order, ("post", kind),
    ("compute", whether a posted receive is still in flight), ("wait",); rank 1 posts each send `delay_s` late."""
    import time

    import torch.distributed as dist

    from megazero.context_parallel import ring
    from megazero.core.topology import Topology
    from megazero.runtime import comm
    from megazero.runtime.parallel_context import ParallelContext

    pctx = ParallelContext(Topology(cp=2))
    events, recvs = [], []
    isend, irecv, wait, kernel_of = comm.isend, comm.irecv, comm.wait, ring._kernel

    def late_isend(t, peer, group):
        if dist.get_rank() == 1:
            time.sleep(delay_s)
        events.append(("post", "send"))
        return isend(t, peer, group)

    def tracked_irecv(t, peer, group):
        work = irecv(t, peer, group)
        recvs.append(work)
        events.append(("post", "recv"))
        return work

    def timed_wait(work, group, received=None):
        wait(work, group, received)
        events.append(("wait",))

    class Tracked:  # the pair kernel the ring picks, each call recorded with whether a receive is in flight
        def __init__(self, kernel):
            self.kernel = kernel

        def forward(self, *args):
            events.append(("compute", any(not w.is_completed() for w in recvs)))
            return self.kernel.forward(*args)

        def backward(self, *args):
            events.append(("compute", any(not w.is_completed() for w in recvs)))
            return self.kernel.backward(*args)

    ring.comm.isend, ring.comm.irecv, ring.comm.wait = late_isend, tracked_irecv, timed_wait
    ring._kernel = lambda blocks, q: Tracked(kernel_of(blocks, q))
    try:
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(1, 2, 8, 4, generator=gen).requires_grad_() for _ in range(3))
        ring.ring_attention(q, k, v, pctx.cp_group, 16).sum().backward()
    finally:
        ring.comm.isend, ring.comm.irecv, ring.comm.wait, ring._kernel = isend, irecv, wait, kernel_of
    pctx.destroy()
    return events


def test_ring_transfers_are_in_flight_while_blocks_compute():
    """cp 2, rank 1 posts each send 0.3 s late: on rank 0, forward posts the next block's exchange, computes its
    own block's pairs while that receive is still in flight, then waits; backward likewise (its dK/dV partial
    posted after the block's computation, waited after the next block's)."""
    events = run_ranks(_ring_events, 2, 0.3)[0]
    compute_fwd = [e for e in events[:events.index(("wait",))] if e[0] == "compute"]
    assert events[:2] == [("post", "send"), ("post", "recv")]
    assert compute_fwd and all(in_flight for _, in_flight in compute_fwd), events  # 3 pairs: own block
    sends = [i for i, e in enumerate(events) if e == ("post", "send")]
    bwd = events[sends[1]:]  # forward: one exchange (cp - 1), then the last block's computation
    assert events[sends[1] - 1][0] == "compute" and bwd[:2] == [("post", "send"), ("post", "recv")]
    first_wait = bwd.index(("wait",))
    assert [e for e in bwd[:first_wait] if e[0] == "compute"] and all(
        e[1] for e in bwd[:first_wait] if e[0] == "compute"), bwd


CONFIG_ERRORS = [  # (overrides, world size, words of the error): refused before any process group
    (["parallel.cp=4", "model.seq_len=36"], 4, ["model.seq_len: 36 must be a multiple of 8 = 2 x parallel.cp"]),
    (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_len=36"], 4,
     ["model.seq_len: 36 must be a multiple of 8", "x parallel.tp (sequence parallel)"]),
    (["parallel.cp=4", "parallel.cp_method=ulysses", "parallel.tp=2"], 8,
     ["parallel.cp_method=ulysses: the 2 attention heads per tensor-parallel rank", "use cp_method=ring"]),
    (["parallel.cp=2", "model.dropout=0.1"], 2, ["model.dropout: 0.1 with parallel.cp=2"]),
    (["parallel.cp=2", "parallel.cp_method=rings"], 2, ["parallel.cp_method: 'rings' is not valid", "ring, ulysses"]),
    (["parallel.cp=3"], 4, ["parallel.pp x parallel.tp x parallel.cp = 1 x 1 x 3 = 3 does not divide world size 4"]),
    (["parallel.cp=2", "zero.stage=3", "zero.hpz_partition_size=2"], 4, ["zero.hpz_partition_size=2 with parallel.cp=2"]),
    (["parallel.cp=2", "model.spec=model_specs/llama.py:debug-moe", "model.moe.capacity_factor=1.25"], 2,
     ["model.moe.capacity_factor=1.25 with parallel.cp=2", "use no capacity (null)"]),
]


@pytest.mark.parametrize("overrides,world,words", CONFIG_ERRORS, ids=[o[0] if len(o) == 1 else o[-1] for o, _, _ in
                                                                    CONFIG_ERRORS])
def test_context_parallel_config_errors_name_the_key(overrides, world, words):
    from megazero.core.config import ConfigError
    from megazero.engine import load_run_config

    with pytest.raises(ConfigError) as info:
        load_run_config("configs/debug_gpt.yaml", ["parallel.pp=1", "parallel.tp=1", "train.micro_batch_size=1",
                                                   "train.global_batch_size=null", *overrides], world_size=world)
    for w in words:
        assert w in str(info.value), str(info.value)


def _initialize_built_module():
    import megazero
    from megazero.core.config import ConfigError

    try:
        megazero.initialize(model=torch.nn.Linear(2, 2), config={"parallel": {"cp": 2}})
    except ConfigError as err:
        return str(err)
    return None


def test_context_parallel_refuses_a_built_module():
    """A user's nn.Module has its own attention, which cannot see tokens on other ranks: refused by name."""
    for message in run_ranks(_initialize_built_module, 2):
        assert message.startswith("parallel.cp=2: context parallelism splits each sequence inside megazero"), message


def test_dry_run_checks_the_cp_ring_and_all_to_alls():
    """The meta-device dry run of pp 2 x tp 2 x cp 2 (ring) simulates both cp ranks of the first and last stage,
    matches their ring sends and receives, and finds no problem; Ulysses at cp 4 the same with all-to-alls.
    The smallest model that has every exchange: one block per stage and two micro-batches (1F1B's warm-up,
    steady and cool-down phases at pp 2) instead of the config's 4 layers and 8 micro-batches (205 s -> 22 s
    for the two dry runs on a loaded 2-core machine)."""
    from megazero.toolbox.dry_run import dry_run

    small = ["data.path=null", "model.layers=2", "train.global_batch_size=4"]
    out = dry_run("configs/debug_llama.yaml", ["parallel.pp=2", "parallel.tp=2", "parallel.cp=2", *small], 8)
    assert out["problems"] == [] and {0, 2, 4, 6} <= set(out["ranks"]), out["problems"]
    out = dry_run("configs/debug_llama.yaml", ["parallel.pp=1", "parallel.tp=1", "parallel.cp=4",
                                               "parallel.cp_method=ulysses", *small], 4)
    assert out["problems"] == [] and out["ranks"] == [0, 1, 2, 3]


def test_deepspeed_ulysses_keys_map_to_cp():
    """DeepSpeed-Ulysses' sequence_parallel_size becomes parallel.cp with cp_method ulysses; its batch arithmetic
    is DeepSpeed's (the data-parallel size is the world over sequence_parallel_size); a 16-bit gradient reduction
    type is refused by name."""
    from megazero.core.config import ConfigError, load_config

    cfg = load_config({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
                       "seq_parallel_communication_data_type": "fp32"}, world_size=4)
    p, t = cfg.parallel, cfg.train
    assert (p.cp, p.cp_method, p.dp, t.gradient_accumulation_steps) == (2, "ulysses", 2, 4)
    with pytest.raises(ConfigError, match='seq_parallel_communication_data_type="bf16": not supported yet'):
        load_config({"train_batch_size": 8, "sequence_parallel_size": 2, "seq_parallel_communication_data_type": "bf16"},
                    world_size=4)


def _long_step(corpus, seq, layers):
    import megazero

    cfg = {"precision": "fp32", "parallel": {"cp": 8},
           "model": {"spec": "model_specs/llama.py:debug", "seq_len": seq, "layers": layers, "vocab": 257},
           "train": {"micro_batch_size": 1, "global_batch_size": 1, "seed": 1234},
           "optimizer": {"type": "adamw", "lr": 1e-3}, "data": {"path": corpus}, "log": {"interval": 1000}}
    engine, _, data, _ = megazero.initialize(config=cfg)
    losses = [engine.train_batch(data) for _ in range(2)]
    return losses, engine.pctx.cp_size


def test_a_32k_token_llama_trains_at_cp_8(corpus):
    """The debug Llama at 32,768 tokens per sequence over 8 cp ranks (4,096 each; ring attention): two steps on
    real text, every rank the same finite losses, the second lower."""
    results = run_ranks(_long_step, 8, corpus, 32768, 1, timeout=600)
    losses = results[0][0]
    assert all(r[0] == losses for r in results) and all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0] and results[0][1] == 8
