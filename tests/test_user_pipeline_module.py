"""A user's own PipelineModule of plain nn.Module layers, trained through `megazero.initialize` with
pp > 1 and no declared activation shapes: the stages agree on each boundary's shape and dtype on the
first micro-batch (megazero.pipeline.p2p) and train exactly like one process.

The layers change width in the middle (16 -> 24 -> 16), so the boundaries between stages (and, with
two chunks per stage, between virtual stages) carry activations of different shapes.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import megazero
from megazero.core.topology import Topology
from megazero.engine.factories import synthetic_batches
from megazero.pipeline.pipeline_module import LayerSpec, PipelineModule
from tests.harness import RankError, run_ranks

VOCAB, SEQ, STEPS, GLOBAL_BATCH, MICRO = 50, 8, 3, 8, 2


class Residual(nn.Module):
    """x + MLP(LayerNorm(x)) on (b, s, width)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def seeded(index: int, make):
    """Layer `index` with the same initial values on whichever stage builds it."""
    torch.manual_seed(1000 + index)
    return make()


FACTORIES = [lambda: nn.Embedding(VOCAB, 16), lambda: Residual(16), lambda: nn.Linear(16, 24),
             lambda: Residual(24), lambda: nn.Linear(24, 16), lambda: nn.Linear(16, VOCAB)]


class TupleEmbedding(nn.Module):
    """input_ids -> (hidden, mask, skip): a bool mask and a second float stream, as DeepSpeed's
    pipeline layers pass tuples (the mask travels without a gradient, skip with one)."""

    def __init__(self):
        super().__init__()
        self.word, self.skip = nn.Embedding(VOCAB, 16), nn.Embedding(VOCAB, 16)

    def forward(self, input_ids):
        return self.word(input_ids), input_ids % 7 != 0, self.skip(input_ids)


class MaskedResidual(Residual):
    """(hidden, mask, skip) -> (hidden + mask * MLP(LayerNorm(hidden)), mask, skip): skip passes through."""

    def forward(self, inputs):
        h, mask, skip = inputs
        return h + mask.unsqueeze(-1) * super().forward(h) - h * mask.unsqueeze(-1), mask, skip


class TupleHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(16, VOCAB)

    def forward(self, inputs):
        h, _, skip = inputs
        return self.out(h + skip)


TUPLE_FACTORIES = [TupleEmbedding, lambda: MaskedResidual(16), lambda: MaskedResidual(16),
                   lambda: MaskedResidual(16), TupleHead]


def loss_fn(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB).float(), labels.reshape(-1))


def user_module(pp: int, stage: int, chunks: int, activation_shape=None, tuples: bool = False) -> PipelineModule:
    layers = [LayerSpec(seeded, i, make) for i, make in enumerate(TUPLE_FACTORIES if tuples else FACTORIES)]
    return PipelineModule(layers, pp, stage, loss_fn, "uniform", chunks=chunks, activation_shape=activation_shape)


def declared_shape(micro_batch_size):  # pp=2, one chunk: the boundary after the 16 -> 24 projection
    return (micro_batch_size, SEQ, 24)


def config(pp: int, dp: int, schedule: str, chunks: int, zero: int) -> dict:
    return {"parallel": {"pp": pp, "tp": 1}, "zero": {"stage": zero}, "comm": {"timeout_s": 20},
            "train": {"micro_batch_size": MICRO, "global_batch_size": GLOBAL_BATCH, "steps": STEPS, "seed": 3},
            "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
            "pipeline": {"schedule": schedule, "chunks": chunks}}


def train(pp: int, dp: int, schedule: str, chunks: int, zero: int, declare: bool = False, eval_first: bool = False,
          tuples: bool = False):
    """Per-step losses, this rank's final parameters by global layer index (dp rank 0 reports) and
    the learned boundaries. `declare`: the module declares its activation shape; `eval_first`: an
    eval batch runs before training (the shapes are then learned by the forward-only program);
    `tuples`: the layers pass (hidden, mask, skip) tuples."""
    import torch.distributed as dist

    stage = Topology(pp=pp, dp=dp).coords(dist.get_rank()).pp  # this rank's stage, before initialize
    module = user_module(pp, stage, chunks, declared_shape if declare else None, tuples)
    engine, optimizer, _, _ = megazero.initialize(model=module, config=config(pp, dp, schedule, chunks, zero))
    if engine.p2p is not None:
        assert (engine.p2p.declared is not None) == declare  # nothing declared: shapes are learned
    gas = GLOBAL_BATCH // (MICRO * dp)
    if eval_first:
        engine.eval_batch(synthetic_batches(VOCAB, MICRO, gas, SEQ, 99, engine.pctx.dp_rank, dp))
    data = synthetic_batches(VOCAB, MICRO, gas, SEQ, 3, engine.pctx.dp_rank, dp)
    losses = [engine.train_batch(data) for _ in range(STEPS)]
    params = {}
    if engine.pctx.dp_rank == 0:
        with optimizer.full_parameters():
            for (lo, _), chunk in zip(module.layer_ranges, module.local_chunks, strict=True):
                for j, layer in enumerate(chunk):
                    for name, p in layer.named_parameters():
                        params[f"{lo + j}.{name}"] = p.detach().clone()
    learned = sorted(engine.p2p.known.items()) if engine.p2p is not None else []
    return losses, params, [(b, metas[0][0] if not is_tuple else metas) for b, (metas, is_tuple) in learned]


_reference = {}


def serial(tuples: bool = False):
    if tuples not in _reference:
        (losses, params, _), = run_ranks(train, 1, 1, 1, "1f1b", 1, 0, False, False, tuples, timeout=120)
        _reference[tuples] = losses, params
    return _reference[tuples]


def assert_like_serial(results, ref_losses, ref_params):
    params = {}
    for losses, mine, _ in results:
        for a, b in zip(losses, ref_losses, strict=True):
            # fp32 against one process: another summation order per step (the parity suites' 1e-5, the worst printed below)
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
        params.update(mine)
    assert set(params) == set(ref_params)
    worst = max((params[k] - ref_params[k]).abs().max().item() for k in params)
    rel = max(abs(a - b) / abs(b) for losses, _, _ in results for a, b in zip(losses, ref_losses, strict=True))
    print(f"losses within {rel:.1e} relative, final parameters within {worst:.1e}")
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("pp, dp, schedule, chunks, zero, declare, eval_first", [
    (2, 1, "1f1b", 1, 0, False, False), (2, 1, "zb-h1", 1, 1, False, False), (2, 2, "gpipe", 1, 2, False, False),
    (2, 1, "interleaved", 2, 0, False, False), (3, 1, "1f1b", 1, 3, False, True), (2, 1, "1f1b", 1, 0, True, False)])
def test_user_pipeline_module_trains_like_one_process(pp, dp, schedule, chunks, zero, declare, eval_first):
    results = run_ranks(train, pp * dp, pp, dp, schedule, chunks, zero, declare, eval_first, timeout=180)
    assert_like_serial(results, *serial())
    # the learned shapes: 6 layers split uniformly over pp * chunks virtual stages ([3, 3], [2, 2, 2] or [2, 2, 1, 1])
    boundary_shapes = dict(b for _, _, learned in results for b in learned)
    if declare:
        assert boundary_shapes == {}
    elif pp == 3:
        assert boundary_shapes == {0: (MICRO, SEQ, 16), 1: (MICRO, SEQ, 24)}
    elif chunks == 1:
        assert boundary_shapes == {0: (MICRO, SEQ, 24)}  # after the 16 -> 24 projection
    else:
        assert boundary_shapes == {0: (MICRO, SEQ, 16), 1: (MICRO, SEQ, 24), 2: (MICRO, SEQ, 16)}  # [2, 2, 1, 1] layers


@pytest.mark.parametrize("pp, dp, schedule, zero", [(2, 2, "1f1b", 2), (3, 1, "zb-h1", 3)])
def test_tuples_of_tensors_pass_between_stages(pp, dp, schedule, zero):
    """(hidden, bool mask, skip) crosses every boundary: the mask travels without a gradient, skip
    passes untouched through the middle stage and still gets its gradient back to the embedding."""
    results = run_ranks(train, pp * dp, pp, dp, schedule, 1, zero, False, False, True, timeout=180)
    assert_like_serial(results, *serial(tuples=True))
    crossing = ((MICRO, SEQ, 16), torch.float32), ((MICRO, SEQ), torch.bool), ((MICRO, SEQ, 16), torch.float32)
    boundaries = dict(b for _, _, learned in results for b in learned)
    assert boundaries == {b: crossing for b in range(pp - 1)}


def shape_change_worker():
    import torch.distributed as dist

    module = user_module(2, dist.get_rank(), 1)  # pp=2, dp=1: the rank is the stage
    cfg = config(2, 1, "1f1b", 1, 0) | {"comm": {"timeout_s": 10}}
    engine, _, _, _ = megazero.initialize(model=module, config=cfg)

    def batches():  # the second micro-batch is one token shorter
        for mb in range(8):
            seq = SEQ if mb % 4 == 0 else SEQ - 1
            tokens = torch.randint(0, VOCAB, (MICRO, seq + 1), generator=torch.Generator().manual_seed(mb))
            yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    engine.train_batch(batches())


def test_a_shape_that_changes_later_names_the_stage_and_both_shapes():
    with pytest.raises(RankError) as err:
        run_ranks(shape_change_worker, 2, timeout=60)
    msg = str(err.value)
    assert "PipelineError: stage 0 (rank 0) waiting at SendAct mb 1 to stage 1" in msg, msg
    assert "has shape (2, 7, 24) torch.float32, but the first micro-batch's activation is (2, 8, 24)" in msg, msg


def wrong_module_worker(num_stages: int, stage_of_rank):
    import torch.distributed as dist

    module = user_module(num_stages, stage_of_rank(dist.get_rank()), 1)
    megazero.initialize(model=module, config=config(2, 1, "1f1b", 1, 0))


def stage_zero(rank):
    return 0


def test_a_module_cut_for_another_pipeline_is_refused():
    with pytest.raises(RankError, match=r"parallel.pp=2, but the PipelineModule was built with num_stages=3"):
        run_ranks(wrong_module_worker, 2, 3, stage_zero, timeout=60)
    with pytest.raises(RankError) as err:  # rank 1 built stage 0's layers: every rank stops, none hangs
        run_ranks(wrong_module_worker, 2, 2, stage_zero, timeout=60)
    msg = str(err.value)
    assert "this rank's module was built with stage=0, its pipeline stage is 1" in msg, msg
    assert "another rank's module was built for another stage" in msg, msg
