"""DeepSpeed's pipeline-parallelism example (DeepSpeedExamples training/pipeline_parallelism/train.py),
written as it writes it, with `import deepspeed` / `from deepspeed...` changed to megazero: its own
--local_rank and --pipeline-parallel-size next to `add_config_arguments`, `init_distributed`, the
accelerator's `set_device`, `torch.manual_seed` and `deepspeed.runtime.utils.set_random_seed`, a
torchvision-style AlexNet joined into one layer list with a lambda (`join_layers`),
`PipelineModule(layers=..., loss_fn=..., num_stages=..., partition_method="parameters",
activation_checkpoint_interval=0)`, the dataset made by local rank 0 first behind barriers,
`initialize(args=..., model=..., model_parameters=..., training_data=...)` and `engine.train_batch()`.
It also reports where `engine.grid` puts the rank (DeepSpeed's PipelineParallelGrid). Smaller than
the original (a tiny AlexNet on 16x16 random images, no torchvision); its dropout is off by default
(`--dropout`) so that the serial reference draws no masks.

    torchrun --nproc_per_node=4 tests/deepspeed_scripts/pipeline_cnn.py --deepspeed_config ds.json -p 2
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

import megazero as deepspeed
from megazero.accelerator import get_accelerator
from megazero.pipe import PipelineModule

IMAGE, CLASSES, SAMPLES = 16, 10, 96


class AlexNet(nn.Module):
    """torchvision's AlexNet layout (features, avgpool, classifier), scaled down."""

    def __init__(self, num_classes=CLASSES, dropout=0.0):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, kernel_size=3, stride=1, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(8, 12, kernel_size=3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(12, 16, kernel_size=3, padding=1), nn.ReLU(inplace=True))
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Linear(32, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def cifar_trainset(local_rank):
    """The example's CIFAR-10 download, rank 0 of each node first; here random images."""
    dist.barrier()
    if local_rank != 0:
        dist.barrier()
    g = torch.Generator().manual_seed(5)
    trainset = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 3, IMAGE, IMAGE, generator=g),
                                              torch.randint(0, CLASSES, (SAMPLES,), generator=g))
    if local_rank == 0:
        dist.barrier()
    return trainset


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="CIFAR")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("-s", "--steps", type=int, default=100, help="quit after this many steps")
    parser.add_argument("-p", "--pipeline-parallel-size", type=int, default=2, help="pipeline parallelism")
    parser.add_argument("--backend", type=str, default="gloo", help="distributed backend")
    parser.add_argument("--seed", type=int, default=1138, help="PRNG seed")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def train_pipe(args, part="parameters"):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=CLASSES, dropout=args.dropout)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = cifar_trainset(args.local_rank)
    engine, _, _, _ = deepspeed.initialize(args=args, model=net,
                                           model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=trainset)
    losses = [float(engine.train_batch()) for _ in range(args.steps)]
    grid = engine.grid
    return {"losses": losses, "stage": grid.get_stage_id(), "dp_rank": grid.get_data_parallel_rank(),
            "dp_size": grid.get_data_parallel_world_size(), "pp_size": grid.get_pipe_parallel_world_size(),
            "dp_ranks": grid.get_data_parallel_group_ranks(), "next_stage": grid.stage_to_global(
                (grid.get_stage_id() + 1) % grid.get_pipe_parallel_world_size()),
            "layers": [type(m).__name__ for chunk in engine.module.local_chunks for m in chunk]}


def main(argv=None):
    args = get_args(argv)
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ["LOCAL_RANK"])
    get_accelerator().set_device(args.local_rank)
    return train_pipe(args)


if __name__ == "__main__":
    print(main())
