"""DeepSpeed's CIFAR-10 tutorial (DeepSpeedExamples training/cifar/cifar10_deepspeed.py), written as
it writes it, with `import deepspeed` changed to `import megazero as deepspeed` and
`from deepspeed.accelerator import ...` to `from megazero.accelerator import ...`: its own
--local_rank next to `add_config_arguments`, `init_distributed()`, the dataset made by rank 0 first
behind a barrier, the DeepSpeed config built as a dict (Adam, WarmupLR, clipping, bf16 or fp32, a
ZeRO stage), `initialize(args=..., model=..., model_parameters=..., training_data=...,
config=...)`, `get_accelerator().device_name(model_engine.local_rank)`, the target dtype from
`bfloat16_enabled()` / `fp16_enabled()`, then `model_engine(inputs)`, `backward`, `step` over the
returned loader. Smaller than the original (tiny images, two epochs of a few batches) and the data
are a fixed random tensor dataset (no torchvision, no download).

    torchrun --nproc_per_node=2 tests/deepspeed_scripts/cifar_cnn.py --stage 2 --dtype bf16
"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import megazero as deepspeed
from megazero.accelerator import get_accelerator

IMAGE, CLASSES, SAMPLES = 12, 10, 64


def add_argument(argv=None):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-e", "--epochs", default=2, type=int, help="number of total epochs (default: 2)")
    parser.add_argument("--log-interval", type=int, default=2000, help="output logging information at a given interval")
    parser.add_argument("--dtype", default="fp32", type=str, choices=["bf16", "fp16", "fp32"], help="Datatype")
    parser.add_argument("--stage", default=0, type=int, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument("--train-batch-size", default=16, type=int)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def trainset():
    """The dataset (the tutorial's torchvision CIFAR10 with normalisation; here random images)."""
    g = torch.Generator().manual_seed(3)
    images = torch.randn(SAMPLES, 3, IMAGE, IMAGE, generator=g)
    labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 8, 3)
        self.fc1 = nn.Linear(8 * 1 * 1, 24)  # 12x12 -> conv 10 -> pool 5 -> conv 3 -> pool 1
        self.fc2 = nn.Linear(24, 16)
        self.fc3 = nn.Linear(16, CLASSES)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def get_ds_config(args):
    """The tutorial's config (its fp16 block too, enabled only with --dtype fp16)."""
    return {
        "train_batch_size": args.train_batch_size,
        "steps_per_print": 2000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                                                 "weight_decay": 3e-7}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                                                     "warmup_num_steps": 1000}},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "bf16": {"enabled": args.dtype == "bf16"},
        "fp16": {"enabled": args.dtype == "fp16", "fp16_master_weights_and_grads": False, "loss_scale": 0,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1, "initial_scale_power": 15},
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": args.stage, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000,
                              "overlap_comm": True, "contiguous_gradients": True, "cpu_offload": False},
    }


def main(argv=None):
    args = add_argument(argv)
    deepspeed.init_distributed()
    if dist.get_rank() != 0:
        dist.barrier()  # the tutorial: rank 0 downloads the data first
    data = trainset()
    if dist.get_rank() == 0:
        dist.barrier()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=data, config=get_ds_config(args))
    local_device = get_accelerator().device_name(model_engine.local_rank)
    local_rank = model_engine.local_rank
    target_dtype = None
    if model_engine.bfloat16_enabled():
        target_dtype = torch.bfloat16
    elif model_engine.fp16_enabled():
        target_dtype = torch.half
    criterion = nn.CrossEntropyLoss()
    losses = []
    for epoch in range(args.epochs):
        running_loss = 0.0
        for i, data_ in enumerate(trainloader):
            inputs, labels = data_[0].to(local_device), data_[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
            running_loss += loss.item()
            if local_rank == 0 and i % args.log_interval == (args.log_interval - 1):
                print(f"[{epoch + 1 : d}, {i + 1 : 5d}] loss: {running_loss / args.log_interval : .3f}")
                running_loss = 0.0
    model_engine.eval()
    probe = data.tensors[0][:4].to(local_device)
    with torch.no_grad():
        logits = model_engine(probe.to(target_dtype) if target_dtype is not None else probe).float()
    return {"losses": losses, "logits": logits.tolist(), "lr": model_engine.get_lr(),
            "dp": model_engine.dp_world_size, "device": local_device}


if __name__ == "__main__":
    result = main()
    if dist.get_rank() == 0:
        print(json.dumps(result))
