"""megazero: 3D-parallel (pipeline x tensor x ZeRO data parallel) training of large transformers."""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """See `megazero.engine.initialize` (imported lazily: `import megazero` stays light)."""
    from megazero.engine import initialize as _initialize

    return _initialize(*args, **kwargs)
