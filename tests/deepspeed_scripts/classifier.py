"""A classifier trained the way DeepSpeed's CIFAR-10 tutorial trains one: argparse with the config
arguments, `initialize(args=..., model=..., model_parameters=...)`, then `model_engine(inputs)`,
`backward`, `step`, and `save_checkpoint` / `load_checkpoint`. The only change from the DeepSpeed
original is the import line. Runs on CPU (`model_engine.device`); the data are random, drawn per
global step, each data-parallel rank taking its slice.

    torchrun --nproc_per_node=2 tests/deepspeed_scripts/classifier.py --deepspeed_config ds.json
"""
import argparse
import json

import torch
import torch.distributed as dist
import torch.nn as nn

import megazero as deepspeed

IN, HIDDEN, CLASSES = 16, 32, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def global_batch(step, size):
    """The global batch of optimizer step `step`: (inputs (size, IN), labels (size,))."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(size, IN, generator=g), torch.randint(0, CLASSES, (size,), generator=g)


EVAL_INPUTS = torch.randn(8, IN, generator=torch.Generator().manual_seed(7))


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="classifier")
    parser.add_argument("--steps", type=int, default=6, help="train until this global step")
    parser.add_argument("--save_dir", default=None)
    parser.add_argument("--load_dir", default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    net = Net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    model_engine, optimizer, _, _ = deepspeed.initialize(args=args, model=net, model_parameters=parameters)
    start = 0
    if args.load_dir is not None:
        _, client_state = model_engine.load_checkpoint(args.load_dir)
        start = client_state["step"]
    criterion = nn.CrossEntropyLoss()
    rank, world = dist.get_rank(), dist.get_world_size()
    micro, gas = model_engine.train_micro_batch_size_per_gpu(), model_engine.gradient_accumulation_steps()
    losses = []
    for step in range(start, args.steps):
        inputs, labels = global_batch(step, model_engine.train_batch_size())
        mine = slice(rank * micro * gas, (rank + 1) * micro * gas)
        total = 0.0
        for x, y in zip(inputs[mine].split(micro), labels[mine].split(micro), strict=True):
            outputs = model_engine(x.to(model_engine.device))
            loss = criterion(outputs, y.to(model_engine.device))
            model_engine.backward(loss)
            model_engine.step()
            total += loss.item() / gas
        t = torch.tensor([total])
        dist.all_reduce(t)
        losses.append(t.item() / world)
    if args.save_dir is not None:
        model_engine.save_checkpoint(args.save_dir, client_state={"step": args.steps})
    model_engine.eval()
    with torch.no_grad():
        logits = model_engine(EVAL_INPUTS.to(model_engine.device))
    return {"losses": losses, "logits": logits.tolist(), "lr": model_engine.get_lr(),
            "grad_norm": model_engine.get_global_grad_norm()}


if __name__ == "__main__":
    result = main()
    if dist.get_rank() == 0:
        print(json.dumps(result))
