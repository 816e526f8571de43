"""A Megatron-style model trained the way Megatron-DeepSpeed drives `deepspeed.checkpointing`, with
`import deepspeed` changed to `import megazero as deepspeed`: the model-parallel unit (`mpu`, here
Megatron's tensor-parallel size 1) handed to `deepspeed.checkpointing.configure(mpu, deepspeed_config=...,
partition_activations=...)`, Megatron's names pointed at DeepSpeed's (`mpu.checkpoint =
deepspeed.checkpointing.checkpoint`, `get_cuda_rng_tracker`, `model_parallel_cuda_manual_seed`), the
seeds set by `model_parallel_cuda_manual_seed`, dropout in the model-parallel region inside
`get_cuda_rng_tracker().fork()` and outside it on the default generator, the transformer blocks run
through `checkpoint(custom(start, end), hidden)` Megatron's way, and `initialize(..., mpu=mpu)`.

The test's reference runs the same model and `setup_checkpointing` with DeepSpeed 0.19.8's own
`deepspeed.checkpointing`, in a plain torch DDP loop.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, HIDDEN, LAYERS, SEQ = 32, 16, 4, 8


class Mpu:
    """Megatron's mpu for tensor- and pipeline-parallel size 1: every rank is a data-parallel rank."""

    def get_tensor_model_parallel_rank(self):
        return 0

    def get_tensor_model_parallel_world_size(self):
        return 1

    def get_tensor_model_parallel_group(self):
        return None

    get_model_parallel_rank, get_model_parallel_world_size = get_tensor_model_parallel_rank, \
        get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_data_parallel_rank(self):
        return dist.get_rank()

    def get_data_parallel_world_size(self):
        return dist.get_world_size()

    def get_data_parallel_group(self):
        return dist.group.WORLD


class Block(nn.Module):
    """A pre-norm MLP block; its inner dropout is in the model-parallel region (the tracker's stream)."""

    def __init__(self, mpu, p=0.2):
        super().__init__()
        self.mpu, self.p = mpu, p
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1, self.fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, h):
        x = F.gelu(self.fc1(self.norm(h)))
        with self.mpu.get_cuda_rng_tracker().fork():
            x = F.dropout(x, self.p, self.training)
        return h + F.dropout(self.fc2(x), self.p, self.training)


class GPTLike(nn.Module):
    def __init__(self, mpu, checkpoint_activations, checkpoint_num_layers=2):
        super().__init__()
        self.mpu, self.checkpoint_activations, self.checkpoint_num_layers = mpu, checkpoint_activations, \
            checkpoint_num_layers
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block(mpu) for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def _checkpointed_forward(self, hidden):
        """Megatron's: the blocks in runs of checkpoint_num_layers, each through mpu.checkpoint."""
        def custom(start, end):
            def custom_forward(x_):
                for layer in self.layers[start:end]:
                    x_ = layer(x_)
                return x_
            return custom_forward

        for start in range(0, LAYERS, self.checkpoint_num_layers):
            hidden = self.mpu.checkpoint(custom(start, start + self.checkpoint_num_layers), hidden)
        return hidden

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        if self.checkpoint_activations:
            h = self._checkpointed_forward(h)
        else:
            for layer in self.layers:
                h = layer(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), labels.reshape(-1))


def batch(step, rank, micro):
    """Rank `rank`'s micro-batch of step `step`: (tokens, labels), each (micro, SEQ)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (micro, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def get_args(argv=None, deepspeed=None):
    parser = argparse.ArgumentParser(description="megatron-style")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--checkpoint-activations", action="store_true")
    parser.add_argument("--partition-activations", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def setup_checkpointing(deepspeed, mpu, args):
    """Megatron's `set_deepspeed_activation_checkpointing` and its seeding."""
    deepspeed.checkpointing.configure(mpu, deepspeed_config=args.deepspeed_config,
                                      partition_activations=args.partition_activations)
    mpu.checkpoint = deepspeed.checkpointing.checkpoint
    mpu.get_cuda_rng_tracker = deepspeed.checkpointing.get_cuda_rng_tracker
    mpu.model_parallel_cuda_manual_seed = deepspeed.checkpointing.model_parallel_cuda_manual_seed
    mpu.model_parallel_cuda_manual_seed(args.seed)


def main(argv=None):
    import megazero as deepspeed

    args = get_args(argv, deepspeed)
    deepspeed.init_distributed()
    mpu = Mpu()
    setup_checkpointing(deepspeed, mpu, args)
    model = GPTLike(mpu, args.checkpoint_activations)
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=model.parameters(), mpu=mpu)
    losses = []
    for step in range(args.steps):
        total = 0.0
        for m in range(engine.gradient_accumulation_steps()):
            tokens, labels = batch(step * engine.gradient_accumulation_steps() + m, dist.get_rank(),
                                   engine.train_micro_batch_size_per_gpu())
            loss = engine(tokens.to(engine.device), labels.to(engine.device))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / engine.gradient_accumulation_steps())
    with deepspeed.zero.GatheredParameters(engine.module.head.weight):
        weight = engine.module.head.weight.detach().float()[:2].tolist()
    return {"losses": losses, "weight": weight}
