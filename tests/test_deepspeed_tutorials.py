"""DeepSpeed's tutorial scripts, written as DeepSpeed writes them and changed only in their imports
(``import megazero as deepspeed``, ``from megazero.accelerator import get_accelerator``), train like
the same training in plain PyTorch on the same batches, 2-4 gloo ranks. Where DeepSpeed's semantics
decide the numbers (its WarmupLR schedule), the reference uses DeepSpeed 0.19.8's own class.

- tests/deepspeed_scripts/cifar_cnn.py (training/cifar/cifar10_deepspeed.py): a CNN, its own
  --local_rank, `get_accelerator()`, the config as a dict (Adam, WarmupLR, clipping), the loader of
  `training_data`; ZeRO 0-3, fp32 and bf16, 2 ranks.
- tests/deepspeed_scripts/pipeline_cnn.py (training/pipeline_parallelism/train.py): a torchvision-style
  CNN joined into a layer list with a lambda, `PipelineModule(..., partition_method="parameters")`,
  `deepspeed.runtime.utils.set_random_seed`, `engine.grid`, `train_batch()`; pp 2 x dp 2.
- tests/deepspeed_scripts/megatron_style.py (Megatron-DeepSpeed's use of `deepspeed.checkpointing`):
  `configure(mpu, ...)`, `checkpoint(custom_forward, ...)` per block, dropout inside
  `get_cuda_rng_tracker().fork()` seeded by `model_parallel_cuda_manual_seed`; its reference runs the
  same model with DeepSpeed 0.19.8's own `deepspeed.checkpointing` under torch DDP.
"""
import copy

import pytest
import torch

from tests.harness import run_ranks

TOL = 1e-5


def _rel(got, want) -> float:
    got, want = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    return ((got - want).abs().max() / want.abs().max()).item()


# -- the CIFAR tutorial --------------------------------------------------------------------------------

CNN_CASES = [(stage, dtype) for dtype in ("fp32", "bf16") for stage in (0, 1, 2, 3)]


def cnn_worker(cases):
    from tests.deepspeed_scripts import cifar_cnn

    return {f"{stage}-{dtype}": cifar_cnn.main(["--stage", str(stage), "--dtype", dtype]) for stage, dtype in cases}


def cnn_reference(dtype: str, dp: int = 2, epochs: int = 2, train_batch: int = 16):
    """The tutorial's training in plain PyTorch: each dp rank's shuffled DistributedSampler batches
    (seed 0, as DeepSpeed's loader), the mean of the ranks' gradients, clipping at 1.0, AdamW (DeepSpeed's
    "Adam" with weight decay is AdamW), DeepSpeed's own WarmupLR stepped after each optimizer step. bf16:
    a bf16 copy of the model computes, its gradients accumulate in fp32 per rank (DeepSpeed's bf16 with
    fp32 master weights and fp32 gradient accumulation), the fp32 master (made from the bf16 weights, as
    DeepSpeed makes it: with the fp32 initial values instead, 48 of 216 elements of one weight differ in
    bf16 after the first step) is updated and copied back."""
    import torch.utils.data as tud
    from deepspeed.runtime.lr_schedules import WarmupLR

    from tests.deepspeed_scripts import cifar_cnn

    torch.manual_seed(0)
    master = cifar_cnn.Net()
    low = copy.deepcopy(master).to(torch.bfloat16) if dtype == "bf16" else master
    with torch.no_grad():  # DeepSpeed casts the module to bf16 first: its fp32 master starts from the bf16 values
        for p, q in zip(master.parameters(), low.parameters(), strict=True):
            p.copy_(q)
    opt = torch.optim.AdamW(master.parameters(), lr=0.001, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    sched = WarmupLR(opt, warmup_min_lr=0, warmup_max_lr=0.001, warmup_num_steps=1000)
    data = cifar_cnn.trainset()
    loaders = [tud.DataLoader(data, batch_size=train_batch // dp,
                              sampler=tud.DistributedSampler(data, num_replicas=dp, rank=r)) for r in range(dp)]
    losses = {r: [] for r in range(dp)}
    for _ in range(epochs):
        for batches in zip(*loaders, strict=True):
            grads = [torch.zeros_like(p) for p in master.parameters()]
            for r, (x, y) in enumerate(batches):
                low.zero_grad()
                out = low(x.to(torch.bfloat16) if dtype == "bf16" else x)
                loss = torch.nn.functional.cross_entropy(out, y)
                loss.backward()
                losses[r].append(loss.item())
                for g, p in zip(grads, low.parameters(), strict=True):
                    g += p.grad.float()
            for p, g in zip(master.parameters(), grads, strict=True):
                p.grad = g / dp
            torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
            opt.step()
            sched.step()
            if dtype == "bf16":
                with torch.no_grad():
                    for q, p in zip(low.parameters(), master.parameters(), strict=True):
                        q.copy_(p)
    probe = data.tensors[0][:4]
    with torch.no_grad():
        logits = low.eval()(probe.to(torch.bfloat16) if dtype == "bf16" else probe).float()
    return losses, logits.tolist()


def test_the_cifar_tutorial_trains_like_pytorch():
    results = run_ranks(cnn_worker, 2, CNN_CASES, timeout=300)
    for dtype in ("fp32", "bf16"):
        losses, logits = cnn_reference(dtype)
        for stage in (0, 1, 2, 3):
            for rank, result in enumerate(results):
                got = result[f"{stage}-{dtype}"]
                assert got["dp"] == 2 and got["device"] == "cpu"
                assert len(got["losses"]) == len(losses[rank]) == 8  # 2 epochs x 4 micro-batches of 8 per rank
                err = _rel(got["losses"], losses[rank])
                print(f"cifar tutorial ZeRO-{stage} {dtype} rank {rank}: losses {err:.1e}, logits "
                      f"{_rel(got['logits'], logits):.1e} relative")
                assert err <= TOL, (stage, dtype, rank, err)
                assert _rel(got["logits"], logits) <= TOL, (stage, dtype, rank)


# -- the pipeline-parallelism example ------------------------------------------------------------------

PIPE_STAGES = (0, 1, 3)  # DeepSpeed refuses ZeRO-2/3 with a pipeline; megazero runs them (3 stands for both)
PIPE_CONFIG = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
               "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8}},
               "steps_per_print": 10, "wall_clock_breakdown": False}


def pipe_worker(paths):
    from tests.deepspeed_scripts import pipeline_cnn

    return {stage: pipeline_cnn.main(["--deepspeed_config", path, "-p", "2", "-s", "3"]) for stage, path in
            paths.items()}


def pipe_reference(steps=3, dp=2, micro=2, gas=4):
    """The example's model trained serially: the same seeds, each dp rank's shuffled DistributedSampler
    micro-batches (DeepSpeed's loader), the mean loss over micro-batches and ranks, clipping at 1.0
    (DeepSpeed's default when the config has none), Adam."""
    import itertools

    import torch.utils.data as tud

    from megazero.runtime.seeding import set_random_seed
    from tests.deepspeed_scripts import pipeline_cnn as script

    torch.manual_seed(1138)
    set_random_seed(1138)
    net = script.AlexNet()
    opt = torch.optim.Adam(net.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-8)
    g = torch.Generator().manual_seed(5)  # the script's dataset, made without its barriers
    data = tud.TensorDataset(torch.randn(script.SAMPLES, 3, script.IMAGE, script.IMAGE, generator=g),
                             torch.randint(0, script.CLASSES, (script.SAMPLES,), generator=g))
    iters = [itertools.cycle(list(tud.DataLoader(data, batch_size=micro, sampler=tud.DistributedSampler(
        data, num_replicas=dp, rank=r)))) for r in range(dp)]
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for r in range(dp):
            for _ in range(gas):
                x, y = next(iters[r])
                loss = torch.nn.functional.cross_entropy(net(x), y) / (gas * dp)
                loss.backward()
                total += loss.item()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return losses


def test_the_pipeline_example_trains_like_pytorch(tmp_path):
    import json

    paths = {}
    for stage in PIPE_STAGES:
        paths[stage] = str(tmp_path / f"zero{stage}.json")
        with open(paths[stage], "w") as f:
            json.dump(dict(PIPE_CONFIG, zero_optimization={"stage": stage}), f)
    results = run_ranks(pipe_worker, 4, paths, timeout=300)
    want = pipe_reference()
    for stage in PIPE_STAGES:
        for rank, result in enumerate(results):
            got = result[stage]
            err = _rel(got["losses"], want)
            print(f"pipeline example ZeRO-{stage} rank {rank}: losses {err:.1e} relative")
            assert err <= TOL, (stage, rank, err)
            # the grid: DeepSpeed's default layout, pipeline outermost, so ranks 0, 1 hold stage 0
            assert (got["stage"], got["dp_rank"], got["dp_size"], got["pp_size"]) == (rank // 2, rank % 2, 2, 2)
            assert got["dp_ranks"] == [2 * (rank // 2), 2 * (rank // 2) + 1]
            assert got["next_stage"] == (rank + 2) % 4
        assert sum(r[stage]["layers"].count("_Fn") for r in results[::2]) == 1  # the lambda: a layer of one stage
        # torchvision's ReLU(inplace=True) right after a layer: it failed ("Output 0 of _PreBackward is a view
        # and is being modified inplace") until ZeRO's backward hook returned a detached alias, not a view
        assert "ReLU" in results[0][stage]["layers"]


# -- a Megatron-style model using deepspeed.checkpointing ----------------------------------------------

MEGATRON_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                   "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
                   "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                                "contiguous_memory_optimization": False,
                                                "synchronize_checkpoint_boundary": False}}
MEGATRON_CASES = [(stage, ckpt) for stage in (0, 1, 2, 3) for ckpt in (True, False)]


def megatron_worker(paths):
    from tests.deepspeed_scripts import megatron_style

    return {(stage, ckpt): megatron_style.main(["--deepspeed_config", paths[stage], "--steps", "4"]
                                               + (["--checkpoint-activations"] if ckpt else []))
            for stage, ckpt in MEGATRON_CASES}


def megatron_reference_worker(path, checkpoint_activations, steps=4, micro=2, gas=2):
    """The same model under DeepSpeed 0.19.8's `deepspeed.checkpointing` (its reentrant checkpoint and
    RNG tracker, configured by the script's own `setup_checkpointing`), trained by torch DDP with AdamW
    and clipping as the config says. DeepSpeed's shared-memory all-reduce kernel (a JIT build its comm
    layer makes at init) is not needed here and is not built."""
    import deepspeed
    import deepspeed.comm.torch as ds_torch_comm
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tests.deepspeed_scripts import megatron_style as script

    ds_torch_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    args = script.get_args(["--deepspeed_config", path, "--steps", str(steps)]
                           + (["--checkpoint-activations"] if checkpoint_activations else []), deepspeed)
    mpu = script.Mpu()
    script.setup_checkpointing(deepspeed, mpu, args)
    model = script.GPTLike(mpu, args.checkpoint_activations)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        total = 0.0
        for m in range(gas):
            tokens, labels = script.batch(step * gas + m, dist.get_rank(), micro)
            loss = ddp(tokens, labels)
            (loss / gas).backward()  # DDP averages over the ranks at every backward; gas divides
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(total / gas)
    return {"losses": losses, "weight": model.head.weight.detach()[:2].tolist()}


def test_a_megatron_style_model_with_deepspeed_checkpointing_trains_like_deepspeeds(tmp_path):
    """Checkpointed and not, at ZeRO 0-3: the same losses and weights as DeepSpeed's checkpointing under
    DDP; checkpointing changes nothing (the recompute replays the dropout masks of both the default
    generator and the tracker's model-parallel stream; dropout p = 0.2 is on in both regions)."""
    import json

    paths = {}
    for stage in (0, 1, 2, 3):
        paths[stage] = str(tmp_path / f"zero{stage}.json")
        with open(paths[stage], "w") as f:
            json.dump(dict(MEGATRON_CONFIG, zero_optimization={"stage": stage}), f)
    got = run_ranks(megatron_worker, 2, paths, timeout=300)
    refs = {ckpt: run_ranks(megatron_reference_worker, 2, paths[0], ckpt, timeout=300) for ckpt in (True, False)}
    for rank in range(2):
        assert refs[True][rank]["losses"] == refs[False][rank]["losses"]  # DeepSpeed's replay is exact too
        for stage, ckpt in MEGATRON_CASES:
            mine, theirs = got[rank][(stage, ckpt)], refs[ckpt][rank]
            err = max(_rel(mine["losses"], theirs["losses"]), _rel(mine["weight"], theirs["weight"]))
            print(f"megatron-style ZeRO-{stage} checkpointed={ckpt} rank {rank}: {err:.1e} relative")
            assert err <= TOL, (stage, ckpt, rank, err)
        assert got[rank][(0, True)]["losses"] == got[rank][(0, False)]["losses"]
    assert got[0][(0, True)]["losses"][0] != got[1][(0, True)]["losses"][0]  # the ranks saw their own data
