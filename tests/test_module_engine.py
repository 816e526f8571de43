"""`megazero.initialize(model=<any nn.Module>)`: DeepSpeed's engine(batch) / backward / step on a
Hugging Face GPT-2 (random init from a small config, nothing downloaded), with ZeRO 0-3 and
optimizer offload on 2 data-parallel ranks, equals torch.optim.AdamW on one process (fp32:
losses within 1e-5 relative, final parameters within 1e-5 absolute)."""
import contextlib

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_ranks

STEPS, MICRO, GAS = 3, 2, 2


def hf_model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def global_batch(step, dp):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 101, (dp * GAS * MICRO, 16), generator=g)


def reference(dp):
    model = hf_model()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-3)
    losses = []
    for s in range(STEPS):
        ids = global_batch(s, dp)
        total = 0.0
        for mb in ids.split(MICRO):
            loss = model(input_ids=mb, labels=mb).loss / (dp * GAS)
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def worker(zero):
    import megazero

    model = hf_model()
    cfg = {"train": {"micro_batch_size": MICRO, "gradient_accumulation_steps": GAS},
           "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1}, "zero": zero}
    decay = [p for p in model.parameters() if p.ndim >= 2]  # the usual no_decay split of HF scripts
    rest = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    engine, optimizer, _, _ = megazero.initialize(model=model, model_parameters=groups, config=cfg)
    dp, r = dist.get_world_size(), dist.get_rank()
    losses = []
    for s in range(STEPS):
        mine = global_batch(s, dp)[r * GAS * MICRO:(r + 1) * GAS * MICRO]
        total = torch.zeros(1)
        for mb in mine.split(MICRO):
            loss = engine(input_ids=mb, labels=mb).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach() / GAS
        dist.all_reduce(total)
        losses.append(total.item() / dp)
    with optimizer.full_parameters():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, params, engine.global_steps


@pytest.mark.parametrize("zero", [{"stage": 0}, {"stage": 1}, {"stage": 2, "overlap_comm": True},
                                  {"stage": 3, "param_persistence_threshold": 0},
                                  {"stage": 2, "offload_optimizer": {"device": "cpu"}}])
def test_hf_model_under_zero_matches_torch_adamw(zero):
    ref_losses, ref_params = reference(2)
    for losses, params, steps in run_ranks(worker, 2, zero, timeout=180):
        assert steps == STEPS
        for a, b in zip(losses, ref_losses, strict=True):
            # fp32 against one process: the data-parallel average adds in another order (the parity suites' 1e-5)
            assert abs(a - b) <= 1e-5 * b
        assert set(params) == set(ref_params)
        worst = max((params[n] - ref_params[n]).abs().max().item() for n in params)
        # fp32 parameters O(0.1-1): another summation order per step (the parity suites' 1e-5)
        assert worst <= 1e-5, worst


class _StubOptimizer:
    """What ModuleEngine calls on its optimizer, doing nothing (the test is about where batches go)."""

    stage = 0
    scaler = type("Scaler", (), {"scale": 1.0})()

    def set_last_microbatch(self, last):
        pass

    def scale_loss(self, loss):
        return loss

    def own_backward(self):
        return contextlib.nullcontext()

    def after_backward(self):
        pass

    def step(self):
        return {}


def test_train_batch_moves_host_batches_to_the_engine_device():
    """initialize(training_data=...) yields host tensors; train_step() without an iterator reads that
    loader and moves each batch (tuples and dicts) to the engine's device: here meta stands in for a GPU,
    and a host tensor reaching the meta weights would raise a device mismatch."""
    from torch.utils.data import DataLoader, TensorDataset

    from megazero.core.topology import Topology
    from megazero.engine.module_engine import ModuleEngine
    from megazero.runtime.parallel_context import ParallelContext

    seen = []

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1, device="meta")

        def forward(self, x, y):
            seen.append((x.device.type, y.device.type))
            return (self.lin(x).squeeze(-1) - y).square().mean()

    data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8)), batch_size=2)
    engine = ModuleEngine(Model(), ParallelContext(Topology(pp=1, dp=1, tp=1)), _StubOptimizer(), None,
                          gradient_accumulation_steps=2, device="meta", training_data=data)
    loss = engine.train_step()
    assert loss.device.type == "meta" and loss.dim() == 0
    assert seen == [("meta", "meta")] * 2
    dicts = iter([{"x": torch.randn(2, 4), "y": torch.randn(2)}] * 2)
    engine.train_step(dicts)
    assert seen[2:] == [("meta", "meta")] * 2
    with pytest.raises(ValueError, match="training_data"):
        ModuleEngine(Model(), ParallelContext(Topology(pp=1, dp=1, tp=1)), _StubOptimizer(), None, 1).train_step()
