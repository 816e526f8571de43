"""L2: Mixture-of-Experts building blocks (routing, dispatch over the expert-parallel group, grouped
experts, the MoE MLP). Import the submodules directly."""
