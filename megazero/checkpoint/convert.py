"""Converting megazero checkpoints one tensor at a time: consolidated state dicts, Hugging Face export
and import. `tools/convert_checkpoint.py` is the command line; `engine.save_16bit_model` uses
`consolidate`.

Everything here runs in one process without torch.distributed. It reads the manifest and then, per
output tensor, only the stored boxes that tensor is made of, and streams the result to the output
file (`megazero.checkpoint.safetensors_io`). Memory is bounded by one output tensor and its inputs (GPT-2's
fused ``c_attn`` needs q, k and v at once), never by the model.

- `consolidate(path, out_file, dtype)`: {logical name: full tensor} as one safetensors file.
- `export_hf(path, out_dir, dtype)`: ``config.json`` + ``model.safetensors`` that `transformers`
  loads (GPT-2 and Llama families; the manifest's model spec decides).
- `import_hf(hf_dir, hf_config, out_dir)`: a megazero checkpoint holding the weights only (one
  file, layout 1 x 1 x 1), which any layout loads like any other checkpoint (a fresh optimizer
  starts from it), and a model-spec file ``model_spec.py`` (flavor ``hf``) to train it with.
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

from megazero.checkpoint import safetensors_io
from megazero.checkpoint.read import CheckpointError, Readers, copy_overlaps
from megazero.checkpoint.sharded import FORMAT, read_manifest, write_and_commit
from megazero.core.spec import ModelSpec, SpecError
from megazero.models.hf import hf_config_dict, hf_export_plan, hf_import_plan, run_plan, spec_from_hf_config
from megazero.runtime.comm import single_rank_group

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def full_tensor(readers: Readers, manifest: dict, name: str, kind: str = "master") -> torch.Tensor:
    """The whole logical tensor `name` (fp32) assembled from its stored `kind` boxes."""
    record = manifest["tensors"].get(name)
    if record is None:
        raise CheckpointError(f"{readers.path}/manifest.json has no tensor {name!r}")
    shape = tuple(record["shape"])
    out = torch.empty(shape, dtype=torch.float32)
    filled = copy_overlaps(readers, record[kind], ((0,) * len(shape), shape), out, shape)
    if filled != out.numel():
        raise CheckpointError(f"{readers.path}: {kind} of {name} is only {filled} of {out.numel()} elements "
                              "in the stored boxes")
    return out


def model_spec(manifest: dict, path: str) -> ModelSpec:
    """The ModelSpec a checkpoint was saved from (recorded in its manifest)."""
    if not manifest.get("model"):
        raise CheckpointError(f"{path}/manifest.json records no model spec (saved from a plain nn.Module); "
                              "only a megazero model's checkpoint can be exported to Hugging Face")
    return ModelSpec(**manifest["model"])


def consolidate(path: str, out_file: str, dtype: torch.dtype = torch.float32, kind: str = "master") -> int:
    """Write {logical name: full tensor} of checkpoint directory `path` (its `kind` tensors, cast to
    `dtype`) to safetensors file `out_file`; returns the bytes of tensor data written."""
    manifest = read_manifest(path)
    if kind not in manifest["kinds"]:
        raise CheckpointError(f"{path} holds no {kind!r} tensors; it has {', '.join(manifest['kinds'])}")
    names = list(manifest["tensors"])
    layout = [(n, dtype, tuple(manifest["tensors"][n]["shape"])) for n in names]
    with Readers(path) as readers:
        tensors = (full_tensor(readers, manifest, n, kind).to(dtype) for n in names)
        return safetensors_io.write(out_file, layout, tensors, {"format": "pt"})


def _shapes(plan, input_shape) -> dict[str, tuple]:
    """Each output's shape, found by running the plan on "meta" tensors (no data)."""
    return {out: tuple(make(*[torch.empty(input_shape(k), device="meta") for k in inputs]).shape)
            for out, (inputs, make) in plan.items()}


def export_hf(path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> dict:
    """Write checkpoint `path` as a Hugging Face model directory `out_dir` (config.json,
    model.safetensors in `dtype`); returns the config written."""
    manifest = read_manifest(path)
    spec = model_spec(manifest, path)
    try:  # a Mixture-of-Experts spec maps to Mixtral when its routing is Mixtral's
        config = dict(hf_config_dict(spec), torch_dtype=str(dtype).removeprefix("torch."))
    except SpecError as err:
        raise CheckpointError(f"{path}: {err}") from None
    plan = hf_export_plan(spec)
    if spec.tie_embeddings:  # transformers ties lm_head to the embedding itself; the file holds one copy
        plan.pop("lm_head.weight")
    shapes = _shapes(plan, lambda name: tuple(manifest["tensors"][name]["shape"]))
    os.makedirs(out_dir, exist_ok=True)
    with Readers(path) as readers:
        tensors = (t.to(dtype) for _, t in run_plan(plan, lambda name: full_tensor(readers, manifest, name)))
        safetensors_io.write(os.path.join(out_dir, "model.safetensors"),
                             [(k, dtype, shapes[k]) for k in plan], tensors, {"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config


class _HFTensors:
    """Lazy access to the tensors of a Hugging Face model directory: model.safetensors, a sharded
    model.safetensors.index.json, or pytorch_model.bin (weights_only, memory-mapped)."""

    def __init__(self, hf_dir: str):
        self.hf_dir, self._open = hf_dir, {}
        index = os.path.join(hf_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                self.where = dict(json.load(f)["weight_map"])
        elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
            from safetensors import safe_open

            with safe_open(os.path.join(hf_dir, "model.safetensors"), framework="pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        elif os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin")):
            state = torch.load(os.path.join(hf_dir, "pytorch_model.bin"), map_location="cpu", weights_only=True,
                               mmap=True)
            self._open["pytorch_model.bin"] = state
            self.where = {k: "pytorch_model.bin" for k in state}
        else:
            raise CheckpointError(f"{hf_dir} has no model.safetensors, model.safetensors.index.json or "
                                  "pytorch_model.bin")
        if self.where and all(k.startswith(("h.", "wte.", "wpe.", "ln_f.")) for k in self.where):
            self.where = {f"transformer.{k}": v for k, v in self.where.items()}  # a GPT2Model's keys
            self._prefix = "transformer."
        else:
            self._prefix = ""

    def _file(self, key: str):
        if key not in self.where:
            raise CheckpointError(f"{self.hf_dir} has no tensor {key!r} (its keys start with {sorted(self.where)[:3]})")
        fname = self.where[key]
        if fname not in self._open:
            from safetensors import safe_open

            self._open[fname] = safe_open(os.path.join(self.hf_dir, fname), framework="pt")
        return self._open[fname], key[len(self._prefix):]

    def shape(self, key: str) -> tuple:
        f, k = self._file(key)
        return tuple(f[k].shape) if isinstance(f, dict) else tuple(f.get_slice(k).get_shape())

    def get(self, key: str) -> torch.Tensor:
        f, k = self._file(key)
        return f[k] if isinstance(f, dict) else f.get_tensor(k)


def import_hf(hf_dir: str, hf_config, out_dir: str, tag: str = "hf") -> str:
    """Write the Hugging Face model in `hf_dir` (its config object `hf_config`, e.g. from
    `transformers.AutoConfig`) as megazero checkpoint `out_dir/tag` (weights only; `latest` names it)
    and a model-spec file `out_dir/model_spec.py`; returns the checkpoint's path."""
    spec = spec_from_hf_config(hf_config)
    source = _HFTensors(hf_dir)
    plan = hf_import_plan(spec)
    shapes = _shapes(plan, source.shape)
    layout = [(f"master/{name}/0", torch.float32, shapes[name]) for name in plan]
    entries = [(name, list(shapes[name]), "master", "rank0.safetensors", f"master/{name}/0",
                [0] * len(shapes[name]), list(shapes[name])) for name in plan]
    meta = {"format": FORMAT, "step": 0,
            "layout": {"pp": 1, "tp": 1, "dp": 1, "order": ["pp", "dp", "tp"], "zero_stage": 0},
            "kinds": ["master"], "rng": False, "model": dataclasses.asdict(spec), "optimizer": None,
            "lr_scheduler": None, "engine": {}, "client_state": {"imported_from": os.path.abspath(hf_dir)},
            "config": None}
    os.makedirs(out_dir, exist_ok=True)
    tensors = (t.float() for _, t in run_plan(plan, source.get))
    path = write_and_commit(out_dir, tag, layout, tensors, entries, meta, 0, True, 0, single_rank_group())
    _write_spec_file(os.path.join(out_dir, "model_spec.py"), spec, hf_dir)
    return path


def _write_spec_file(path: str, spec: ModelSpec, source: str) -> None:
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "name"}
    body = ",\n".join(f"    {k}={v!r}" for k, v in fields.items())
    with open(path, "w") as f:
        f.write(f'"""The architecture of {source}, imported by tools/convert_checkpoint.py."""\n'
                "from megazero.core.spec import ModelSpec\n\n"
                f"FLAVORS = {{\"hf\": ModelSpec(\n{body},\n)}}\n")
