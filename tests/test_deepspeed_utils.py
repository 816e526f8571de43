"""`megazero.utils`' per-parameter views of the ZeRO optimizer (DeepSpeed's `safe_get_*` / `safe_set_*`)
and `zero_to_fp32` (its functions and the script `save_checkpoint` leaves in the directory), at ZeRO 0-3
on 2 ranks, against the same training in plain PyTorch (torch.optim.Adam: its exp_avg, exp_avg_sq)."""
import os
import subprocess
import sys

import pytest
import torch

from tests.harness import run_ranks

CFG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
       "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "adam_w_mode": False}}}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def batch(rank):
    g = torch.Generator().manual_seed(rank)
    return torch.randn(2, 6, generator=g), torch.randn(2, 3, generator=g)


def _worker(stage, save_dir):
    import torch.distributed as dist

    import megazero as deepspeed
    from megazero.utils import (safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state,
                                safe_get_local_fp32_param, safe_get_local_grad, safe_set_full_fp32_param,
                                safe_set_full_grad)

    net = model()
    engine, *_ = deepspeed.initialize(model=net, config=dict(CFG, zero_optimization={"stage": stage}))
    params = list(net.parameters())
    x, y = batch(dist.get_rank())
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    grads = [safe_get_full_grad(p) for p in params]
    local = [(safe_get_local_fp32_param(p), safe_get_local_grad(p)) for p in params]
    safe_set_full_grad(params[0], 2 * grads[0])  # the step applies the doubled gradient of the first weight
    engine.step()
    after = [safe_get_full_fp32_param(p) for p in params]
    states = [(safe_get_full_optimizer_state(p, "exp_avg"), safe_get_full_optimizer_state(p, "exp_avg_sq"))
              for p in params]
    safe_set_full_fp32_param(params[2], torch.zeros(3, 10))  # the next forward sees it
    with deepspeed.zero.GatheredParameters(params[2]):
        zeroed = params[2].detach().clone()
    engine.save_checkpoint(save_dir)
    with pytest.raises(ValueError, match="megazero's Adam keeps exp_avg, exp_avg_sq"):
        safe_get_full_optimizer_state(params[0], "momentum_buffer")
    assert safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(1))) is None  # not a megazero optimizer's
    return {"grads": grads, "local": local, "after": after, "states": states, "zeroed": zeroed}


def _reference():
    net = model()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    loss = sum(torch.nn.functional.mse_loss(net(x), y) for x, y in (batch(0), batch(1))) / 2
    loss.backward()
    grads = [p.grad.clone() for p in net.parameters()]
    next(net.parameters()).grad *= 2
    opt.step()
    return grads, [p.detach().clone() for p in net.parameters()], \
        [(opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]) for p in net.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_and_set_equal_pytorch_and_zero_to_fp32_recovers_the_weights(stage, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    got = run_ranks(_worker, 2, stage, save_dir, timeout=120)
    grads, after, states = _reference()
    for rank, r in enumerate(got):
        for a, b in zip(r["grads"], grads, strict=True):
            # fp32 against a plain PyTorch run: the data-parallel average sums the same gradients in another order (~8 ulps); atol for near-0 entries
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for a, b in zip(r["after"], after, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for (m, v), (m0, v0) in zip(r["states"], states, strict=True):
            # fp32 as above; Adam's states are smaller than the weights (m ~ g, v ~ g^2), so their atol is smaller
            torch.testing.assert_close(m, m0, rtol=1e-6, atol=1e-8)
            torch.testing.assert_close(v, v0, rtol=1e-6, atol=1e-10)
        assert torch.equal(r["zeroed"], torch.zeros(3, 10))
    for i, g in enumerate(grads):  # the two ranks' local pieces make the whole (stage 0: each holds all)
        pieces = [r["local"][i][1] for r in got]
        whole = pieces[0] if stage == 0 else torch.cat(pieces)
        # fp32 as above: the gathered gradient sums the same terms in another order (~8 ulps)
        torch.testing.assert_close(whole, g.reshape(-1), rtol=1e-6, atol=1e-7)
    # the script save_checkpoint left, run as DeepSpeed documents it, in a fresh process
    out = tmp_path / "fp32"
    script = os.path.join(save_dir, "zero_to_fp32.py")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, script, save_dir, str(out), "--safe_serialization"], check=True, env=env,
                   capture_output=True, text=True)
    from safetensors.torch import load_file

    saved = load_file(str(out / "model.safetensors"))
    want = dict(zip(("0.weight", "0.bias", "2.weight", "2.bias"), after, strict=True))
    want["2.weight"] = torch.zeros(3, 10)
    assert sorted(saved) == sorted(want)
    for k, v in want.items():
        # fp32 as above: the weights after the same steps, updated from gradients averaged in another order
        torch.testing.assert_close(saved[k], v, rtol=1e-6, atol=1e-7)
    from megazero.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict, \
        get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert sorted(state) == sorted(want) and all(torch.equal(state[k], saved[k]) for k in want)

    files = convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "sharded"), max_shard_size=200)
    assert [os.path.basename(f) for f in files][-1] == "pytorch_model.bin.index.json" and len(files) >= 3
    loaded = load_state_dict_from_zero_checkpoint(model(), save_dir)
    assert torch.equal(loaded[2].weight.detach(), torch.zeros(3, 10))
