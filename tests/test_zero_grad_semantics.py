"""PyTorch's gradient semantics at the module engine's edge, at ZeRO 0-3 on 2 ranks (dp = 2), each
case against plain PyTorch on one process over the same global batches (parameters within 1e-6
relative after the case's steps), or against the documented difference, or refused with a clear error:

- `module.zero_grad()` (set_to_none True / False) and the client's or the returned optimizer's
  `zero_grad()` before `engine.backward` clear what a backward outside the engine left in `p.grad`:
  same. Between `engine.backward` and `engine.step`: the returned optimizer's (and `engine.zero_grad()`)
  drops the engine's gradients, as PyTorch; `module.zero_grad()` and the client's do not (differs,
  as DeepSpeed's ZeRO: the engine's gradients live in its flat buffers, not in `p.grad`).
- `p.grad` between `engine.backward` and `engine.step`: reads None (differs, as DeepSpeed's ZeRO); a
  gradient written there joins the step's at stages 0-1 (averaged over dp, as DDP averages) and is
  refused at the step at stages 2-3; one written before `engine.backward` joins that backward: same.
- gradients from `torch.autograd.backward` / `loss.backward()` outside `engine.backward` stay in
  `p.grad` (same); still there at the next `engine.backward` they join it (same, with gradient
  accumulation too: only the engine's own loss is divided by it); still there at the step they join it
  at stages 0-1 (same) and are refused at 2-3.
- several `engine.backward` calls before one step add up, through one graph with `retain_graph=True`
  too: same (stages 0-1 with overlap_comm: a second one at the boundary is refused).
- a parameter with no gradient in a step: a parameter used on one rank only gets the dp average (same);
  one no rank used is updated with a zero gradient (its Adam moments decay) where torch.optim skips it
  (differs from PyTorch, same as DeepSpeed at every stage: tests/test_deepspeed_grad_semantics.py).

One `run_ranks` per stage runs every case (a module fixture); each test checks one case.
"""
import pytest
import torch

from tests.harness import run_ranks

DP, MICRO, LR = 2, 2, 1e-2
STAGES = (0, 1, 2, 3)
TOL = 1e-6


class Block(torch.nn.Module):
    """A tiny MLP with a side branch `extra` that a case may leave unused."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 1)
        self.extra = torch.nn.Linear(4, 1)

    def forward(self, x, use_extra=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        if use_extra is not None:  # (rows,) bool: the rows whose output adds the branch
            out = out + self.extra(x) * use_extra[:, None]
        return out


class Net(torch.nn.Module):
    """One block in a ModuleList: ZeRO-3 gathers it as one unit on every rank, the branch included, so a
    rank may leave the branch unused (`megazero.engine.factories.zero_units`)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.ModuleList([Block()])

    def forward(self, x, use_extra=None):
        return self.body[0](x, use_extra)


def batch(step, rank=None):
    """Step `step`'s global batch (x (4, 4), y (4, 1)), or dp rank `rank`'s half of it."""
    g = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(DP * MICRO, 4, generator=g), torch.randn(DP * MICRO, 1, generator=g)
    if rank is None:
        return x, y
    return x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]


def loss_of(net, x, y, use_extra=None):
    return (net(x, use_extra) - y).square().mean()


def outside_loss(net, x):
    """A second objective whose backward runs outside the engine (another engine's, the user's)."""
    return net(x).sin().mean()


def fresh():
    torch.manual_seed(0)
    return Net()


# -- each case: (megazero on a rank, plain PyTorch on the global batch) -------------------------------------

def engine_for(stage, overlap=False, gas=1):
    import megazero

    net = fresh()
    client = torch.optim.Adam(net.parameters(), lr=LR)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": stage, "overlap_comm": overlap}}
    engine, optimizer, _, _ = megazero.initialize(model=net, optimizer=client, config=cfg)
    return engine, optimizer, client, net


def final(engine):
    """{name: full parameter} after the case (all-gathered at stage 3)."""
    with engine.optimizer.full_parameters():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def torch_run(body, steps=2):
    """Plain PyTorch: `body(net, opt, step)` per step, then opt.step(); the final parameters."""
    net = fresh()
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    for step in range(steps):
        body(net, opt, step)
        opt.step()
    return {n: p.detach().clone() for n, p in net.named_parameters()}


def mz_outside_then_zero(stage, rank, how):
    """A backward outside the engine, then a zero_grad (`how`), then the engine's backward and step."""
    engine, optimizer, client, net = engine_for(stage)
    for step in range(2):
        x, y = batch(step, rank)
        outside_loss(net, x * 2).backward()
        {"module": lambda: net.zero_grad(), "module-zeros": lambda: net.zero_grad(set_to_none=False),
         "client": lambda: client.zero_grad(), "returned": lambda: optimizer.zero_grad(),
         "returned-zeros": lambda: optimizer.zero_grad(set_to_none=False)}[how]()
        engine.backward(loss_of(engine, x, y))
        engine.step()
    return final(engine)


def pt_clean(net, opt, step):
    x, y = batch(step)
    opt.zero_grad()
    loss_of(net, x, y).backward()


def mz_zero_between(stage, rank, how):
    """engine.backward(a), a zero_grad (`how`), engine.backward(b), engine.step()."""
    engine, optimizer, client, net = engine_for(stage)
    for step in range(2):
        x, y = batch(step, rank)
        engine.backward(loss_of(engine, x, y))
        {"module": lambda: net.zero_grad(), "client": lambda: client.zero_grad(),
         "returned": lambda: optimizer.zero_grad(), "engine": lambda: engine.zero_grad()}[how]()
        engine.backward(loss_of(engine, x * 0.5, y))
        engine.step()
    return final(engine)


def pt_two_backward(dropped):
    def body(net, opt, step):
        x, y = batch(step)
        opt.zero_grad()
        loss_of(net, x, y).backward()
        if dropped:
            opt.zero_grad()
        loss_of(net, x * 0.5, y).backward()
    return body


def mz_two_backward(stage, rank, overlap=False):
    engine, *_ = engine_for(stage, overlap)
    try:
        for step in range(2):
            x, y = batch(step, rank)
            engine.backward(loss_of(engine, x, y))
            engine.backward(loss_of(engine, x * 0.5, y))
            engine.step()
    except RuntimeError as e:
        return str(e)
    return final(engine)


def mz_retained_graph(stage, rank):
    """Two engine.backward calls through one forward's graph (retain_graph=True on the first)."""
    engine, *_ = engine_for(stage)
    for step in range(2):
        x, y = batch(step, rank)
        out = engine(x)
        engine.backward((out - y).square().mean(), retain_graph=True)
        engine.backward(out.sin().mean())
        engine.step()
    return final(engine)


def pt_retained_graph(net, opt, step):
    x, y = batch(step)
    opt.zero_grad()
    out = net(x)
    (out - y).square().mean().backward(retain_graph=True)
    out.sin().mean().backward()


def mz_grad_reads(stage, rank):
    """What p.grad holds right after engine.backward (None for every parameter, as DeepSpeed's ZeRO)."""
    engine, *_ = engine_for(stage)
    x, y = batch(0, rank)
    engine.backward(loss_of(engine, x, y))
    seen = [p.grad is None for p in engine.module.parameters()]
    engine.step()
    return seen


G_WRITE = 0.25  # the gradient a case writes into fc2.bias.grad on every rank


def mz_grad_write(stage, rank, when):
    engine, _, _, net = engine_for(stage)
    try:
        for step in range(2):
            x, y = batch(step, rank)
            if when == "before":
                net.body[0].fc2.bias.grad = torch.full_like(net.body[0].fc2.bias, G_WRITE)
            engine.backward(loss_of(engine, x, y))
            if when == "after":
                net.body[0].fc2.bias.grad = torch.full_like(net.body[0].fc2.bias, G_WRITE)
            engine.step()
    except RuntimeError as e:
        return str(e)
    return final(engine)


def pt_grad_write(net, opt, step):
    pt_clean(net, opt, step)
    net.body[0].fc2.bias.grad += G_WRITE


def mz_outside_kept(stage, rank, engine_backward):
    """torch.autograd.backward outside the engine, not cleared; then engine.backward (if
    `engine_backward`) and engine.step()."""
    engine, *_ = engine_for(stage)
    try:
        for step in range(2):
            x, y = batch(step, rank)
            torch.autograd.backward(outside_loss(engine.module, x * 2))
            if engine_backward:
                engine.backward(loss_of(engine, x, y))
            engine.step()
    except RuntimeError as e:
        return str(e)
    return final(engine)


def pt_outside_kept(engine_backward):
    def body(net, opt, step):
        x, y = batch(step)
        opt.zero_grad()
        for r in range(DP):  # each rank's outside loss over its own rows, averaged over dp as DDP would
            outside_loss(net, batch(step, r)[0] * 2).div(DP).backward()
        if engine_backward:
            loss_of(net, x, y).backward()
    return body


def mz_outside_with_accumulation(stage, rank):
    """gradient_accumulation_steps 2: before each micro-batch's engine.backward a backward outside the
    engine, not cleared: it joins that micro-batch's gradient as it is (engine.backward divides only its
    own loss by 2)."""
    engine, *_ = engine_for(stage, gas=2)
    for step in range(2):
        for j in range(2):
            x, y = batch(2 * step + j, rank)
            outside_loss(engine.module, x * 2).backward()
            engine.backward(loss_of(engine, x, y))
            engine.step()
    return final(engine)


def pt_outside_with_accumulation(net, opt, step):
    opt.zero_grad()
    for j in range(2):
        for r in range(DP):
            outside_loss(net, batch(2 * step + j, r)[0] * 2).div(DP).backward()
        loss_of(net, *batch(2 * step + j)).div(2).backward()


def extra_rows(step, rank=None):
    """Which rows use the side branch: every row at step 0, rank 0's rows at step 1, none at step 2."""
    rows = torch.tensor([[True] * 4, [True, True, False, False], [False] * 4][step])
    return rows if rank is None else rows[rank * MICRO:(rank + 1) * MICRO]


def mz_unused(stage, rank):
    engine, *_ = engine_for(stage)
    for step in range(3):
        x, y = batch(step, rank)
        use = extra_rows(step, rank)
        engine.backward(loss_of(engine, x, y, use if use.any() else None))
        engine.step()
    return final(engine)


def pt_unused(zero_filled):
    def body(net, opt, step):
        x, y = batch(step)
        use = extra_rows(step)
        opt.zero_grad()
        loss_of(net, x, y, use if use.any() else None).backward()
        if zero_filled:  # what the ZeRO optimizer's update sees: a zero gradient, not None
            for p in net.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
    return body


def worker(stage):
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {}
    for how in ("module", "module-zeros", "client", "returned", "returned-zeros"):
        out[f"outside_then_zero/{how}"] = mz_outside_then_zero(stage, rank, how)
    for how in ("module", "client", "returned", "engine"):
        out[f"zero_between/{how}"] = mz_zero_between(stage, rank, how)
    out["two_backward"] = mz_two_backward(stage, rank)
    out["two_backward/overlap"] = mz_two_backward(stage, rank, overlap=True)
    out["two_backward/retained"] = mz_retained_graph(stage, rank)
    out["grad_reads"] = mz_grad_reads(stage, rank)
    for when in ("before", "after"):
        out[f"grad_write/{when}"] = mz_grad_write(stage, rank, when)
    for eb in (True, False):
        out[f"outside_kept/{eb}"] = mz_outside_kept(stage, rank, eb)
    out["unused"] = mz_unused(stage, rank)
    out["outside_gas2"] = mz_outside_with_accumulation(stage, rank)
    return out


@pytest.fixture(scope="module")
def results():
    cache = {}

    def get(stage):
        if stage not in cache:
            cache[stage] = run_ranks(worker, DP, stage, timeout=240)
        return cache[stage]
    return get


def assert_same(got, want, what):
    for name, w in want.items():
        err = ((got[name] - w).abs().max() / w.abs().max()).item()
        assert err <= TOL, (what, name, err)


def assert_ranks_agree(per_rank, key):
    for name, t in per_rank[0][key].items():
        assert torch.equal(t, per_rank[1][key][name]), (key, name)


# -- the tests ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", ["module", "module-zeros", "client", "returned", "returned-zeros"])
def test_zero_grad_clears_gradients_from_outside_the_engine(results, stage, how):
    """module.zero_grad() (set_to_none True and False), the client's and the returned optimizer's
    zero_grad(), before engine.backward, drop what another backward left in p.grad: same as PyTorch."""
    per_rank = results(stage)
    assert_ranks_agree(per_rank, f"outside_then_zero/{how}")
    assert_same(per_rank[0][f"outside_then_zero/{how}"], torch_run(pt_clean), (stage, how))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("how", ["module", "client", "returned", "engine"])
def test_zero_grad_between_backward_and_step(results, stage, how):
    """The returned optimizer's zero_grad() and engine.zero_grad() between engine.backward and step drop
    the engine's gradients, as PyTorch drops p.grad; module.zero_grad() and the client optimizer's do not
    reach the flat buffers (differs: as in DeepSpeed's ZeRO, the engine's gradients are not in p.grad)."""
    per_rank = results(stage)
    assert_ranks_agree(per_rank, f"zero_between/{how}")
    dropped = how in ("returned", "engine")
    assert_same(per_rank[0][f"zero_between/{how}"], torch_run(pt_two_backward(dropped)), (stage, how))


@pytest.mark.parametrize("stage", STAGES)
def test_several_backward_calls_before_one_step_add_up(results, stage):
    per_rank = results(stage)
    assert_ranks_agree(per_rank, "two_backward")
    assert_same(per_rank[0]["two_backward"], torch_run(pt_two_backward(False)), stage)


@pytest.mark.parametrize("stage", STAGES)
def test_two_backward_calls_through_one_graph(results, stage):
    """engine.backward(loss, retain_graph=True), as DeepSpeed's, then a second backward through the graph."""
    per_rank = results(stage)
    assert_ranks_agree(per_rank, "two_backward/retained")
    assert_same(per_rank[0]["two_backward/retained"], torch_run(pt_retained_graph), stage)


@pytest.mark.parametrize("stage", STAGES)
def test_several_backward_calls_with_overlap_comm(results, stage):
    """Stages 2-3 reduce each backward's gradients into the shard: same. Stages 0-1 with overlap_comm
    reduce during the backward at the boundary, so a second one is refused, naming what works."""
    got = results(stage)[0]["two_backward/overlap"]
    if stage >= 2:
        assert_same(got, torch_run(pt_two_backward(False)), stage)
    else:
        assert isinstance(got, str) and f"ZeRO stage {stage} with overlap_comm" in got and "overlap_comm false" in got, got


@pytest.mark.parametrize("stage", STAGES)
def test_p_grad_reads_none_between_backward_and_step(results, stage):
    """Differs from PyTorch, as DeepSpeed's ZeRO: the engine's gradients are in its flat buffers."""
    assert all(results(stage)[0]["grad_reads"])


@pytest.mark.parametrize("stage", STAGES)
def test_p_grad_written_before_backward_joins_it(results, stage):
    per_rank = results(stage)
    assert_ranks_agree(per_rank, "grad_write/before")
    assert_same(per_rank[0]["grad_write/before"], torch_run(pt_grad_write), stage)


@pytest.mark.parametrize("stage", STAGES)
def test_p_grad_written_after_backward(results, stage):
    """Stages 0-1: joins the step's gradient (averaged over dp, as DDP would average it); stages 2-3
    reduced every bucket inside the backward: refused at the step, naming the parameter and what works."""
    got = results(stage)[0]["grad_write/after"]
    if stage <= 1:
        assert_same(got, torch_run(pt_grad_write), stage)
    else:
        assert isinstance(got, str) and "engine.step()" in got and f"ZeRO stage {stage}" in got, got
        assert "module.zero_grad()" in got and "(1,)" in got, got


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("engine_backward", [True, False])
def test_backward_outside_the_engine(results, stage, engine_backward):
    """torch.autograd.backward outside engine.backward: the gradient stays in p.grad; followed by
    engine.backward it joins that backward (every stage), alone it joins the step at stages 0-1 and is
    refused at stages 2-3."""
    got = results(stage)[0][f"outside_kept/{engine_backward}"]
    if engine_backward or stage <= 1:
        assert_same(got, torch_run(pt_outside_kept(engine_backward)), (stage, engine_backward))
    else:
        assert isinstance(got, str) and "came after the last engine.backward" in got, got


@pytest.mark.parametrize("stage", STAGES)
def test_backward_outside_the_engine_with_gradient_accumulation(results, stage):
    per_rank = results(stage)
    assert_ranks_agree(per_rank, "outside_gas2")
    assert_same(per_rank[0]["outside_gas2"], torch_run(pt_outside_with_accumulation), stage)


@pytest.mark.parametrize("stage", STAGES)
def test_parameters_without_a_gradient(results, stage):
    """`extra` is used by every row, then by rank 0's rows only (same as PyTorch: the dp average),
    then by none: torch.optim.Adam skips it, megazero updates it with a zero gradient (differs)."""
    got = results(stage)[0]["unused"]
    assert_same(got, torch_run(pt_unused(zero_filled=True), steps=3), stage)
    skipped = torch_run(pt_unused(zero_filled=False), steps=3)
    assert_same({k: v for k, v in got.items() if ".extra." not in k},
                {k: v for k, v in skipped.items() if ".extra." not in k}, stage)
    assert (got["body.0.extra.weight"] - skipped["body.0.extra.weight"]).abs().max() > 1e-4  # the documented difference
