"""Install megazero. `MEGAZERO_BUILD_OPS=1 pip install .` also builds the C++/CUDA kernels ahead of time."""
import os

from setuptools import find_packages, setup


def _ext_modules():
    if os.environ.get("MEGAZERO_BUILD_OPS") != "1":
        return [], {}
    from megazero.runtime.kernels.build import aot_extensions  # noqa: E402  (needs torch at build time)

    return aot_extensions()


ext_modules, cmdclass = _ext_modules()

setup(
    name="megazero",
    version="0.1.0",
    description="3D-parallel (PP x TP x DP/ZeRO) training of large transformers, debuggable on CPU",
    packages=find_packages(include=["megazero", "megazero.*"]),
    package_data={"megazero.runtime.kernels": ["csrc/**/*", "csrc/*"]},
    python_requires=">=3.10",
    # An unpinned torch: a user's CUDA build already satisfies it and is never replaced.
    install_requires=["torch>=2.5", "einops>=0.7", "networkx>=3.0", "omegaconf>=2.3", "tqdm>=4.60", "safetensors>=0.4"],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6", "transformers>=4.40", "ninja", "playwright>=1.40", "matplotlib>=3.7"],
        "viz": ["matplotlib>=3.7"],  # PNG and PDF schedule pictures (SVG, HTML and text need nothing)
        "bench": ["ninja", "tokenizers>=0.15", "deepspeed==0.19.8"],
        "monitor": ["tensorboard>=2.14"],  # DeepSpeed's tensorboard monitor (csv needs nothing; wandb: pip install wandb)
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
