"""DeepSpeed's CIFAR-10 tutorial with Mixture of Experts (DeepSpeedExamples training/cifar/
cifar10_deepspeed.py, `--moe`): a CNN whose last hidden layer is a list of `deepspeed.moe.layer.MoE`
layers (an `nn.Linear` expert, `--num-experts`, `--ep-world-size`, `--top-k`, `--min-capacity`,
`--noisy-gate-policy`, `--mlp-type residual` for PR-MoE), `--moe-param-group` groups from
`split_params_into_different_moe_groups_for_optimizer`, the tutorial's DeepSpeed config (Adam,
WarmupLR, gradient clipping 1.0, `--stage`, `--dtype`), `initialize(args=..., model=...,
model_parameters=..., training_data=..., config=...)` and its loader, `model_engine(inputs)`,
`backward`, `step`.

Changed from the original: the imports (``import megazero as deepspeed``, megazero's `accelerator` and
`moe.utils`), a tiny CNN on random 8x8 "CIFAR" images (nothing is downloaded), `--steps` / `--seed` /
`--warmup` / `--gradient-clipping`, the model seeded before it is built, and `main` returns the per-step
losses (averaged over the ranks, as the tutorial's running loss) instead of printing them.

    torchrun --nproc_per_node=2 tests/deepspeed_scripts/cifar_moe.py --moe --ep-world-size 2 \
        --num-experts 4 --moe-param-group --dtype fp32
"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import megazero as deepspeed
from megazero.accelerator import get_accelerator
from megazero.moe.utils import split_params_into_different_moe_groups_for_optimizer

IMAGES, SIZE, CLASSES = 64, 8, 10


def add_argument(argv=None):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("-e", "--epochs", default=30, type=int, help="number of total epochs (default: 30)")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=6, help="stop after this many steps")
    parser.add_argument("--seed", type=int, default=0, help="the model's initial weights")
    parser.add_argument("--warmup", type=int, default=1000, help="WarmupLR's warmup_num_steps")
    parser.add_argument("--gradient-clipping", type=float, default=1.0, help="the config's gradient_clipping")
    parser.add_argument("--dtype", default="fp16", type=str, choices=["bf16", "fp16", "fp32"],
                        help="Datatype used for training")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--moe", default=False, action="store_true", help="use deepspeed mixture of experts (moe)")
    parser.add_argument("--ep-world-size", default=1, type=int, help="(moe) expert parallel world size")
    parser.add_argument("--num-experts", type=int, nargs="+", default=[1], help="number of experts list, MoE related.")
    parser.add_argument("--mlp-type", type=str, default="standard",
                        help="Only applicable when num-experts > 1, accepts [standard, residual]")
    parser.add_argument("--top-k", default=1, type=int, help="(moe) gating top 1 and 2 supported")
    parser.add_argument("--min-capacity", default=0, type=int,
                        help="(moe) minimum capacity of an expert regardless of the capacity_factor")
    parser.add_argument("--noisy-gate-policy", default=None, type=str,
                        help="(moe) noisy gating (only supported with top-1). Valid values are None, RSample, and Jitter")
    parser.add_argument("--moe-param-group", default=False, action="store_true",
                        help="(moe) create separate moe param groups, required when using ZeRO w. MoE")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def create_moe_param_groups(model):
    """Create separate parameter groups for each expert."""
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def get_ds_config(args):
    """Get the DeepSpeed configuration dictionary."""
    return {
        "train_batch_size": 16,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": args.warmup}},
        "gradient_clipping": args.gradient_clipping,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


class Net(nn.Module):
    def __init__(self, args):
        super(Net, self).__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(6 * 3 * 3, 24)
        self.fc2 = nn.Linear(24, 16)
        self.moe = args.moe
        if self.moe:
            fc3 = nn.Linear(16, 16)
            self.moe_layer_list = []
            for n_e in args.num_experts:
                # Create moe layers based on the number of experts.
                self.moe_layer_list.append(
                    deepspeed.moe.layer.MoE(
                        hidden_size=16,
                        expert=fc3,
                        num_experts=n_e,
                        ep_size=args.ep_world_size,
                        use_residual=args.mlp_type == "residual",
                        k=args.top_k,
                        min_capacity=args.min_capacity,
                        noisy_gate_policy=args.noisy_gate_policy,
                    )
                )
            self.moe_layer_list = nn.ModuleList(self.moe_layer_list)
            self.fc4 = nn.Linear(16, CLASSES)
        else:
            self.fc3 = nn.Linear(16, CLASSES)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = x.view(-1, 6 * 3 * 3)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        if self.moe:
            for layer in self.moe_layer_list:
                x, _, _ = layer(x)
            x = self.fc4(x)
        else:
            x = self.fc3(x)
        return x


def trainset():
    """Random 8x8 RGB images and labels in place of torchvision's CIFAR10."""
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randn(IMAGES, 3, SIZE, SIZE, generator=g),
                                          torch.randint(0, CLASSES, (IMAGES,), generator=g))


def main(argv=None):
    args = add_argument(argv)
    deepspeed.init_distributed()
    torch.manual_seed(args.seed)  # every rank builds the same model
    net = Net(args)
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    if args.moe_param_group:
        parameters = create_moe_param_groups(net)
    ds_config = get_ds_config(args)
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=trainset(), config=ds_config)
    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        for i, data in enumerate(trainloader):
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            t = loss.detach().float().reshape(1)
            dist.all_reduce(t)
            losses.append(t.item() / dist.get_world_size())
            if len(losses) == args.steps:
                return {"losses": losses, "groups": [(g.get("name"), g.get("moe", False), len(g["params"]))
                                                     for g in optimizer.param_groups]}
    return {"losses": losses}


if __name__ == "__main__":
    result = main()
    if dist.get_rank() == 0:
        print(json.dumps(result))
