"""A PipelineModule of plain layers trained the way DeepSpeed's pipeline tutorial trains one: the layer
list, `PipelineModule(layers=..., loss_fn=..., num_stages=..., partition_method=...)` with no stage
(each process finds its own), `initialize(model=..., model_parameters=..., training_data=...)` and
`engine.train_batch()` over the training data's (inputs, labels) pairs. The only change from the
DeepSpeed original is the import lines (`megazero` for `deepspeed`).
"""
import torch
import torch.nn as nn

import megazero as deepspeed
from megazero.pipe import PipelineModule

IN, HIDDEN, CLASSES, SAMPLES = 16, 32, 4, 64


def layers():
    torch.manual_seed(0)
    return [nn.Linear(IN, HIDDEN), nn.ReLU(), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
            nn.Linear(HIDDEN, CLASSES)]


def dataset():
    g = torch.Generator().manual_seed(11)
    return torch.utils.data.TensorDataset(torch.randn(SAMPLES, IN, generator=g),
                                          torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def main(ds_config, steps=6, num_stages=2, activation_checkpoint_interval=0):
    deepspeed.init_distributed()
    net = PipelineModule(layers=layers(), loss_fn=nn.CrossEntropyLoss(), num_stages=num_stages,
                         partition_method="uniform", activation_checkpoint_interval=activation_checkpoint_interval)
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
                                           training_data=dataset(), config=ds_config)
    losses = [engine.train_batch() for _ in range(steps)]
    return {"losses": losses, "first": engine.is_first_stage(), "last": engine.is_last_stage()}
