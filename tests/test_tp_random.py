"""RNG-state tracker and dropout: named streams, reproducibility, state save/restore, mask injection.

Multi-rank dropout behaviour (TP-stream masks differ across ranks, replicated ones agree, tp=2 equals
tp=1 with injected masks) is checked in tests/test_models.py, which shares its rank runs.
"""
import pytest
import torch

from megazero.tensor_parallel import (REPLICATED_STREAM, TP_STREAM, Dropout, LogicalMaskFn, RNGStatesTracker,
                                      ShardInfo, set_dropout_mask_fn)


def test_streams_depend_on_seed_and_tp_rank_as_documented():
    def draw(tracker, stream):
        return torch.rand(8, generator=tracker.generator(stream, "cpu"))
    a0, a1, b0 = RNGStatesTracker(1, tp_rank=0), RNGStatesTracker(1, tp_rank=1), RNGStatesTracker(1, tp_rank=0)
    assert torch.equal(draw(a0, REPLICATED_STREAM), draw(a1, REPLICATED_STREAM))
    assert not torch.equal(draw(a0, TP_STREAM), draw(a1, TP_STREAM))
    assert torch.equal(draw(RNGStatesTracker(1, 0), TP_STREAM), draw(b0, TP_STREAM))
    assert not torch.equal(draw(RNGStatesTracker(2, 0), TP_STREAM), draw(RNGStatesTracker(1, 0), TP_STREAM))
    assert not torch.equal(draw(RNGStatesTracker(1, 0, pp_rank=1), TP_STREAM), draw(RNGStatesTracker(1, 0), TP_STREAM))
    with pytest.raises(KeyError, match="unknown RNG stream 'nope'"):
        a0.generator("nope", "cpu")
    with pytest.raises(ValueError, match="already exists"):
        a0.add(TP_STREAM, 3)


def test_get_and_set_states_replay_masks():
    tracker = RNGStatesTracker(5)
    drop = Dropout(0.5, tracker, TP_STREAM, "site").train()
    x = torch.ones(64)
    saved = tracker.get_states()
    first = drop(x)
    assert not torch.equal(first, drop(x))  # the stream advances
    tracker.set_states(saved)
    assert torch.equal(first, drop(x))  # recomputation replays the same mask
    assert set(first.unique().tolist()) <= {0.0, 2.0}


def test_fork_runs_global_rng_code_on_a_stream_and_restores():
    tracker = RNGStatesTracker(7)
    torch.manual_seed(0)
    expected_global = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork(TP_STREAM):
        a = torch.rand(3)
    assert torch.equal(torch.rand(3), expected_global)  # global RNG untouched
    with tracker.fork(TP_STREAM):
        b = torch.rand(3)
    fresh = RNGStatesTracker(7)
    with fresh.fork(TP_STREAM):
        assert torch.equal(torch.rand(3), a) and torch.equal(torch.rand(3), b)


def test_dropout_eval_identity_and_bad_probability():
    drop = Dropout(0.3, RNGStatesTracker(0), REPLICATED_STREAM, "s").eval()
    x = torch.randn(5)
    assert drop(x) is x
    with pytest.raises(ValueError, match="s: dropout probability must be in"):
        Dropout(1.0, RNGStatesTracker(0), REPLICATED_STREAM, "s")


def test_injected_masks_are_slices_of_the_logical_mask():
    p = 0.25
    full = Dropout(p, RNGStatesTracker(0), TP_STREAM, "attn").train()
    shards = [Dropout(p, RNGStatesTracker(0, r), TP_STREAM, "attn", ShardInfo(1, r, 2)).train() for r in range(2)]
    assert set_dropout_mask_fn(torch.nn.ModuleList([full]), LogicalMaskFn(3, p)) == 1
    for shard in shards:  # each rank has its own mask function (it counts calls per site)
        assert set_dropout_mask_fn(shard, LogicalMaskFn(3, p)) == 1
    x = torch.randn(2, 4, 6, 6)
    ref = full(x)
    got = torch.cat([d(c) for d, c in zip(shards, x.chunk(2, dim=1), strict=True)], dim=1)
    assert torch.equal(got, ref)
    assert 0.1 < (ref == 0).float().mean().item() < 0.4
    again = full(x)  # the second call at a site draws a new mask
    assert not torch.equal(again, ref)
    bad = Dropout(p, RNGStatesTracker(0), TP_STREAM, "bad").train()
    bad.mask_fn = lambda site, shape, shard: torch.ones(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="bad: injected mask has shape"):
        bad(x)
