"""ZeRO-3 parameter gathering: each unit (a layer) all-gathers its parameters over dp just before
its forward and again just before its backward, and frees them right after.

Each bucket gathers into one buffer kept for the whole run (`FlatGroup.gather_bucket`) whose
storage is freed to 0 bytes on release, so views autograd saved in forward hold no memory and read
the re-gathered values in backward. The rule that follows: a unit's parameters are read only
inside its own forward and backward (or inside `GatheredParameters`, outside a forward); a module
that reads another's parameter registers it (`register_external_parameter`, DeepSpeed's), and its
unit gathers it too.

Hooks on each unit module: forward-pre (gather + prefetch the next units' buckets asynchronously
up to `prefetch_bucket_size` elements), forward (release), full-backward-pre (gather again +
prefetch the previous units), and the optimizer's gradient hooks report finished buckets so a
unit is released as soon as its backward is done. Buckets are reference-counted: a parameter used
by two units (a tied embedding with pp=1) stays gathered while either needs it.

Every dp rank must issue its gathers and its gradient reductions in one order (they share the dp
group). With a graph that depends on the data the optimizer launches the reductions only at the end of
each unit's backward (`megazero.zero.unit_ends`), before the previous unit's gathers on every rank,
and tells the gatherer (`backward_ended`), which releases the unit if some of its gradients never came.
"""
from __future__ import annotations

import torch


class Stage3Gatherer:
    """Owns the gather/release hooks of the ZeRO-3 `groups` for the modules in `units`
    (forward order). Communicates over each group's dp group (all-gather)."""

    def __init__(self, units, groups, prefetch_bucket_size: int):
        self.groups = groups
        self.prefetch = prefetch_bucket_size
        where = {id(p): (gi, group.layout.bucket_of(i)) for gi, group in enumerate(groups) for i, p in enumerate(group.params)}
        self.needs: list[list[tuple[int, int]]] = []
        unit_ids = {id(m) for m in units}
        for mod in units:
            used = list(mod.parameters()) + external_parameters(mod, unit_ids)
            keys = sorted({where[id(p)] for p in used if id(p) in where})
            self.needs.append(keys)
        self.full: dict[tuple[int, int], torch.Tensor] = {}
        self.inflight: dict[tuple[int, int], tuple] = {}
        self.holders: dict[tuple[int, int], int] = {}
        self.bwd_left: dict[int, set] = {}  # unit -> buckets whose gradients are still expected
        self.handles = []
        for u, mod in enumerate(units):
            self.handles.append(mod.register_forward_pre_hook(self._pre_forward(u)))
            self.handles.append(mod.register_forward_hook(self._post_forward(u)))

    # -- hooks --------------------------------------------------------------------------------------
    def _pre_forward(self, u):
        def hook(mod, args):
            self._acquire(u)
            self._prefetch(range(u + 1, len(self.needs)))
        return hook

    def _post_forward(self, u):
        def hook(mod, args, out):
            self._release(u)
            if torch.is_grad_enabled():
                return call_in_backward(out, lambda: self._pre_backward(u))
            return None
        return hook

    def _pre_backward(self, u) -> None:
        """Runs when the first gradient reaches unit u's outputs."""
        if u in self.bwd_left:
            return
        self._acquire(u)
        self.bwd_left[u] = set(self.needs[u])
        self._prefetch(range(u - 1, -1, -1))

    def backward_ended(self, u) -> None:
        """Unit u's backward is over (`megazero.zero.unit_ends`): release it if some of its gradients
        never came on this rank (a skipped expert), as it is released elsewhere when they all come."""
        if self.bwd_left.pop(u, None) is not None:
            self._release(u)

    # -- gather / release ---------------------------------------------------------------------------
    def _launch(self, key) -> None:
        if key in self.full or key in self.inflight:
            return
        gi, b = key
        self.inflight[key] = self.groups[gi].gather_bucket(b, async_op=True)

    def _prefetch(self, order) -> None:
        budget = self.prefetch
        for v in order:
            for key in self.needs[v]:
                n = self.groups[key[0]].layout.buckets[key[1]].numel
                if budget < n:
                    return
                budget -= n
                self._launch(key)

    def _acquire(self, u) -> None:
        for key in self.needs[u]:
            if key not in self.full:
                self._launch(key)
                work, full = self.inflight.pop(key)
                if work is not None:
                    work.wait()
                self.full[key] = full
                self.groups[key[0]].attach_bucket(key[1], full)
            self.holders[key] = self.holders.get(key, 0) + 1

    def _drop(self, key) -> None:
        self.holders[key] -= 1
        if self.holders[key] <= 0:
            self.holders.pop(key)
            self.full.pop(key, None)
            self.groups[key[0]].release_bucket(key[1])

    def _release(self, u) -> None:
        for key in self.needs[u]:
            if key in self.holders:
                self._drop(key)

    def bucket_done(self, group, b: int) -> None:
        """Called by the optimizer when every gradient of `group`'s bucket b has arrived."""
        key = (self.groups.index(group), b)
        for u, left in list(self.bwd_left.items()):
            left.discard(key)
            if not left:
                del self.bwd_left[u]
                self._release(u)

    def release_all(self) -> None:
        """Free every gathered or in-flight bucket (end of a micro-batch's backward)."""
        for key, (work, _) in list(self.inflight.items()):
            if work is not None:
                work.wait()
            self.groups[key[0]].release_bucket(key[1])  # prefetched, never attached: free its storage
        self.inflight.clear()
        for key in list(self.full):
            self.groups[key[0]].release_bucket(key[1])
        self.full.clear()
        self.holders.clear()
        self.bwd_left.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _PreBackward(torch.autograd.Function):
    """Identity forward; in backward, calls `callback` before passing the gradient on (on a unit's
    outputs: its backward begins; on its inputs: its backward has ended)."""

    @staticmethod
    def forward(ctx, callback, x):
        ctx.callback = callback
        # not x.view_as(x): autograd forbids in-place ops on a custom Function's view outputs, and a
        # user's next layer may be one (torchvision's ReLU(inplace=True)); detach() shares x's storage
        # and version counter, so an in-place op that would corrupt a saved tensor still raises
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        ctx.callback()
        return None, grad


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """DeepSpeed's `zero.register_external_parameter`: `module`'s forward uses `parameter`, which
    another module owns (a tied weight read by a head, a shared bias). At stage 3 the unit that holds
    `module` gathers it too (kept in the module's ``zero_external_parameters``, a user's module being
    where DeepSpeed keeps it as well); without it the parameter holds no values there. Register
    before `megazero.initialize`. Local: no communication."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter: expected an nn.Parameter, got {type(parameter).__name__}")
    external = module.__dict__.setdefault("zero_external_parameters", [])
    if all(p is not parameter for p in external):
        external.append(parameter)


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Undo `register_external_parameter` (a parameter never registered is an error, as DeepSpeed's)."""
    external = module.__dict__.get("zero_external_parameters", [])
    if all(p is not parameter for p in external):
        raise ValueError("unregister_external_parameter: this parameter was not registered on the module")
    external[:] = [p for p in external if p is not parameter]


def external_parameters(unit: torch.nn.Module, unit_ids: set) -> list:
    """The parameters registered as external on `unit` or on the modules inside it that are not
    units of their own."""
    found, stack = [], [unit]
    while stack:
        m = stack.pop()
        found.extend(m.__dict__.get("zero_external_parameters", ()))
        stack.extend(c for c in m.children() if id(c) not in unit_ids)
    return found


def call_in_backward(out, callback):
    """Route every differentiable tensor of a module's outputs (or inputs) through _PreBackward: the
    same structure back, `callback()` called in backward when each one's gradient arrives."""
    if isinstance(out, torch.Tensor):
        return _PreBackward.apply(callback, out) if out.requires_grad else out
    if isinstance(out, (tuple, list)):
        return type(out)(call_in_backward(o, callback) for o in out)
    if isinstance(out, dict):
        return {k: call_in_backward(v, callback) for k, v in out.items()}
    return out
