"""A GAN trained the way DeepSpeed's DCGAN tutorial (DeepSpeedExamples training/gan) trains one: a
generator and a discriminator, each with its own client `torch.optim.Adam` and its own engine from
`initialize(args=..., model=..., model_parameters=..., optimizer=...)`; per step the discriminator's
`netD.zero_grad()`, a backward of its loss on real data and another on the (detached) fakes, one
`step()`; then `netG.zero_grad()` and the generator's loss, which backpropagates through the
discriminator (its parameters get gradients that `netD.zero_grad()` must clear before the
discriminator's next step), backward and step. The modules are called directly (`netD(real)`), as
the tutorial does. The only change from the DeepSpeed original is the import line; the networks
are tiny MLPs and the data random, drawn per global step, each data-parallel rank taking its slice.

    torchrun --nproc_per_node=2 tests/deepspeed_scripts/gan.py --deepspeed_config ds.json
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn as nn

import megazero as deepspeed

NZ, HIDDEN, FEATURES = 4, 16, 6
LR, BETA1 = 5e-3, 0.5


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(NZ, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, FEATURES), nn.Tanh())

    def forward(self, z):
        return self.main(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1), nn.Sigmoid())

    def forward(self, x):
        return self.main(x)


def global_batch(step, size):
    """The global batch of step `step`: (real samples (size, FEATURES), noise (size, NZ))."""
    g = torch.Generator().manual_seed(2000 + step)
    real = torch.tanh(torch.randn(size, FEATURES, generator=g) * 0.5 + 0.3)
    return real, torch.randn(size, NZ, generator=g)


def get_args(argv=None):
    parser = argparse.ArgumentParser(description="gan")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = get_args(argv)
    deepspeed.init_distributed()
    torch.manual_seed(0)
    netG, netD = Generator(), Discriminator()
    criterion = nn.BCELoss()
    real_label, fake_label = 1.0, 0.0
    optimizerD = torch.optim.Adam(netD.parameters(), lr=LR, betas=(BETA1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=LR, betas=(BETA1, 0.999))
    model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(),
                                                           optimizer=optimizerD)
    model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(),
                                                           optimizer=optimizerG)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro = model_engineD.train_micro_batch_size_per_gpu()
    losses_d, losses_g = [], []
    for step in range(args.steps):
        real_all, noise_all = global_batch(step, micro * world)
        real, noise = real_all[rank * micro:(rank + 1) * micro], noise_all[rank * micro:(rank + 1) * micro]
        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        label = torch.full((micro,), real_label)
        output = netD(real).view(-1)
        errD_real = criterion(output, label)
        model_engineD.backward(errD_real)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach()).view(-1)
        errD_fake = criterion(output, label)
        model_engineD.backward(errD_fake)
        errD = errD_real + errD_fake
        model_engineD.step()
        # (2) Update G: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)  # fake labels are real for the generator's cost
        output = netD(fake).view(-1)
        errG = criterion(output, label)
        model_engineG.backward(errG)
        model_engineG.step()
        both = torch.stack([errD.detach(), errG.detach()]).double()
        dist.all_reduce(both)
        losses_d.append(both[0].item() / world)
        losses_g.append(both[1].item() / world)
    return {"loss_d": losses_d, "loss_g": losses_g}


if __name__ == "__main__":
    print(main())
