"""megazero: 3D-parallel (pipeline x tensor x ZeRO data parallel) training of large transformers."""

__version__ = "0.1.0"
