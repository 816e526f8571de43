"""The batched p2p path (NCCL's batch_isend_irecv) without NCCL: one process, one thread per stage, and
torch.distributed's send/recv/batch_isend_irecv/barrier replaced by an in-process rendezvous network
(a send completes once its receive took it; every wait times out, so nothing can hang). The real
`comm` wrappers, `PipeP2P` and `PipelineExecutor` run on top of it.

For 1F1B, interleaved and ZB-H1 at pp=2 and 4, blocking and batched runs are compared: every batch
holds exactly the ops of one run of consecutive p2p instructions (split only around a boundary's
metadata message, which moves alone), every op is posted once, in program order, with the same peer
and the same tensor as on the blocking path, and losses, gradients and byte counts agree. The blocking
path never batches. Plus: `comm.batch_isend_irecv` counts like send/recv, the backend decides the
path (NCCL batched, gloo blocking), and a failed batch names all of its instructions.
"""
from __future__ import annotations

import threading
from collections import defaultdict, deque

import pytest
import torch
import torch.distributed as dist

from megazero.core.instructions import P2P, RecvAct, RecvGrad, SENDS, p2p_runs, parse_program
from megazero.core.schedules import get_schedule
from megazero.pipeline.executor import PipelineError, PipelineExecutor
from megazero.pipeline.p2p import ENTRY, MAX_TENSORS, PipeP2P
from megazero.pipeline.pipeline_module import LayerSpec, PipelineModule
from megazero.runtime import comm
from megazero.runtime.comm import CommStats, GroupHandle, PeerOp, single_rank_group

VOCAB, HID, SEQ, MB, M = 7, 6, 3, 2, 4
META_NUMEL = 2 + MAX_TENSORS * ENTRY


# -- an in-process rendezvous network in place of torch.distributed's p2p ------------------------------

class FakeNet:
    """Point-to-point between threads: the sends on channel (src, dst) are taken by its receives in
    posting order; a send completes when taken. `log[rank]` lists the ops a rank posted (kind, peer,
    a copy of the tensor: sent, or received) in posting order; `batches[rank]` each batch's (kind, peer)."""

    def __init__(self, size: int, timeout: float = 60.0):
        self.cv = threading.Condition()
        self.channels = defaultdict(deque)  # (src, dst) -> slots {"tensor", "taken"} not yet received
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.timeout = timeout
        self.log = defaultdict(list)
        self.batches = defaultdict(list)
        self.barriers = defaultdict(int)

    def _wait(self, ready, what: str) -> None:
        if not self.cv.wait_for(ready, timeout=self.timeout):
            raise TimeoutError(f"fake network: {what} timed out after {self.timeout} s")

    def post_send(self, src: int, dst: int, tensor: torch.Tensor) -> dict:
        with self.cv:
            slot = {"tensor": tensor, "taken": False}
            self.channels[(src, dst)].append(slot)
            self.cv.notify_all()
        return slot

    def wait_sent(self, slots) -> None:
        with self.cv:
            self._wait(lambda: all(s["taken"] for s in slots), "a send")

    def receive(self, dst: int, wanted) -> None:
        """Fill each (src, buffer) of `wanted`, in any order across channels, in order within one."""
        pending = list(wanted)
        with self.cv:
            def take_ready():
                blocked = set()  # a channel's later receive waits for its earlier one
                for item in list(pending):
                    src, buf = item
                    if src in blocked or not self.channels[(src, dst)]:
                        blocked.add(src)
                        continue
                    slot = self.channels[(src, dst)].popleft()
                    buf.copy_(slot["tensor"])
                    slot["taken"] = True
                    pending.remove(item)
                    self.cv.notify_all()
                return not pending
            self._wait(take_ready, "a receive")


class FakePG:
    """Stands for one stage's pp process group (global rank = group rank = stage)."""

    def __init__(self, rank: int, net: FakeNet):
        self.rank, self.net = rank, net


class _Work:
    def __init__(self, wait):
        self.wait = wait


def _no_isend(*args, **kwargs):
    raise AssertionError("isend outside a batch")


def _no_irecv(*args, **kwargs):
    raise AssertionError("irecv outside a batch")


class FakeP2POp:
    """torch.distributed.P2POp without a real group."""

    def __init__(self, op, tensor, peer, group):
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


def install(monkeypatch):
    """Replace torch.distributed's p2p, batch and barrier by FakeNet's, routed by the group argument."""
    def send(tensor, dst, group):
        net, me = group.net, group.rank
        net.log[me].append(("send", dst, tensor.clone()))
        net.wait_sent([net.post_send(me, dst, tensor)])

    def recv(tensor, src, group):
        group.net.receive(group.rank, [(src, tensor)])
        group.net.log[group.rank].append(("recv", src, tensor.clone()))

    def batch_isend_irecv(ops):
        group = ops[0].group
        net, me = group.net, group.rank
        net.batches[me].append([("send" if op.op is _no_isend else "recv", op.peer) for op in ops])
        slots, wanted, entries = [], [], []
        for op in ops:
            if op.op is _no_isend:
                net.log[me].append(("send", op.peer, op.tensor.clone()))
                slots.append(net.post_send(me, op.peer, op.tensor))
            else:
                entries.append((len(net.log[me]), op))
                net.log[me].append(None)  # filled with the received data once the batch completes
                wanted.append((op.peer, op.tensor))

        def wait():
            net.receive(me, wanted)
            net.wait_sent(slots)
            for k, op in entries:
                net.log[me][k] = ("recv", op.peer, op.tensor.clone())
        return [_Work(wait)]

    def barrier(group=None):
        group.net.barriers[group.rank] += 1
        group.net.barrier.wait()

    monkeypatch.setattr(dist, "send", send)
    monkeypatch.setattr(dist, "recv", recv)
    monkeypatch.setattr(dist, "isend", _no_isend)
    monkeypatch.setattr(dist, "irecv", _no_irecv)
    monkeypatch.setattr(dist, "P2POp", FakeP2POp)
    monkeypatch.setattr(dist, "batch_isend_irecv", batch_isend_irecv)
    monkeypatch.setattr(dist, "barrier", barrier)


# -- two small models: one declared activation tensor, or a learned tuple (float, bool, int64) ----------

class Embed(torch.nn.Module):
    def __init__(self, tuple_out=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HID, generator=torch.Generator().manual_seed(1)))
        self.tuple_out = tuple_out

    def forward(self, ids):
        h = self.weight[ids]  # (mb, seq, hid)
        return (h, ids % 2 == 0, ids.to(torch.int64)) if self.tuple_out else h


class Block(torch.nn.Module):
    def __init__(self, i, tuple_io=False):
        super().__init__()
        g = torch.Generator().manual_seed(10 + i)
        self.fc = torch.nn.Linear(HID, HID)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(HID, HID, generator=g) * 0.4)
            self.fc.bias.copy_(torch.randn(HID, generator=g) * 0.1)
        self.tuple_io = tuple_io

    def forward(self, x):
        if not self.tuple_io:
            return x + torch.tanh(self.fc(x))
        h, mask, pos = x
        return h + torch.tanh(self.fc(h)) * mask.unsqueeze(-1) + 0.01 * pos.unsqueeze(-1), mask, pos


class Head(torch.nn.Module):
    def __init__(self, tuple_in=False):
        super().__init__()
        self.proj = torch.nn.Linear(HID, VOCAB)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(VOCAB, HID, generator=torch.Generator().manual_seed(3)) * 0.5)
            self.proj.bias.zero_()
        self.tuple_in = tuple_in

    def forward(self, x):
        return self.proj(x[0] if self.tuple_in else x)


def loss_fn(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def layers(tuples: bool):
    return [LayerSpec(Embed, tuples)] + [LayerSpec(Block, i, tuples) for i in range(6)] + [LayerSpec(Head, tuples)]


def microbatches(m):
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, VOCAB, (2, m, MB, SEQ), generator=g)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(m)]


def reference_loss(tuples: bool) -> float:
    model = PipelineModule(layers(tuples), 1, 0, loss_fn, "uniform")
    return sum(model(b).item() for b in microbatches(M)) / M


class FakeOptimizer:
    """The executor's optimizer protocol, keeping every gradient in `param.grad`."""

    def scale_loss(self, loss):
        return loss

    def set_last_microbatch(self, last):
        pass

    def after_backward(self):
        pass

    def accumulate_grad_into(self, param, add_into):
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        add_into(param.grad)

    def reduce_grads(self):
        pass

    def step(self):
        return {}


def run_pipeline(monkeypatch, schedule, p, chunks, batched, tuples):
    """Every stage of one step in its own thread over a FakeNet; per stage: its program, the ops
    logged after each instruction, losses, gradients and comm stats. Returns (net, results)."""
    install(monkeypatch)
    net = FakeNet(p)
    programs = get_schedule(schedule, p, M, chunks)
    results, errors = [None] * p, []

    def stage(s):
        try:
            group = GroupHandle("pp", tuple(range(p)), s, FakePG(s, net), CommStats())
            model = PipelineModule(layers(tuples), p, s, loss_fn, "uniform", chunks=chunks)
            p2p = PipeP2P(group, None if tuples else (MB, SEQ, HID), torch.float32, batched=batched)
            trace = []  # (instruction, ops this stage had logged when it was reported)
            ex = PipelineExecutor(model, p2p, FakeOptimizer(), s, p, rank=s,
                                  on_instruction=lambda ins, t0, t1: trace.append((ins, len(net.log[s]))))
            st = ex.run(programs[s], iter(microbatches(M)), M)
            grads = {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}
            results[s] = dict(program=programs[s], trace=trace, losses=[x.item() for x in st.losses],
                              grads=grads, stats=group.stats.snapshot())
        except BaseException as exc:  # noqa: BLE001  (reported by the test below)
            errors.append((s, exc))
            net.barrier.abort()

    threads = [threading.Thread(target=stage, args=(s,), daemon=True) for s in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=150)
    assert not any(t.is_alive() for t in threads), "a stage thread is still running"
    if errors:
        raise errors[0][1]
    return net, results


def _is_meta(entry) -> bool:
    """Whether a logged op is a boundary's metadata message (the models' int64 tensors are smaller)."""
    _, _, t = entry
    return t.dtype == torch.int64 and t.shape == (META_NUMEL,)


def expected_batches(program, trace, log):
    """The batches the batched path must post, read off the blocking run: per run of consecutive p2p
    instructions, the (kind, peer) of its instructions' ops in order, cut around each metadata
    message, which is a batch of its own."""
    first = [0] + [logged for _, logged in trace]  # instruction pos logged ops first[pos]:first[pos + 1]
    out = []
    for start, stop in p2p_runs(program):
        part = []
        for entry in log[first[start]:first[stop]]:
            if _is_meta(entry):
                out += [part, [entry]] if part else [[entry]]
                part = []
            else:
                part.append(entry)
        out += [part] if part else []
    return [[(kind, peer) for kind, peer, _ in batch] for batch in out]


def check_same_traffic(blocking, batched, net_blocking, net_batched):
    """Per stage: the same ops (kind, peer, tensor) in the same order on both paths, batched exactly
    as `expected_batches` says; the same losses, gradients and byte counts."""
    for s, (a, b) in enumerate(zip(blocking, batched, strict=True)):
        program = a["program"]
        assert [ins for ins, _ in a["trace"]] == list(program) == [ins for ins, _ in b["trace"]]
        log_a, log_b = net_blocking.log[s], net_batched.log[s]
        assert len(log_a) == len(log_b)
        for (ka, pa, ta), (kb, pb, tb) in zip(log_a, log_b, strict=True):
            assert (ka, pa) == (kb, pb) and ta.dtype == tb.dtype and torch.equal(ta, tb), (s, ka, pa)
        # the blocking path never batches nor joins a barrier; the batched one joins one barrier
        assert net_blocking.batches[s] == [] and net_blocking.barriers[s] == 0
        assert net_batched.barriers[s] == 1
        assert net_batched.batches[s] == expected_batches(program, a["trace"], log_a), s
        assert a["losses"] == b["losses"]
        assert a["grads"].keys() == b["grads"].keys() and a["grads"]
        for name in a["grads"]:
            assert torch.equal(a["grads"][name], b["grads"][name]), (s, name)
        assert a["stats"] == b["stats"]


def check_one_op_per_instruction(results, net):
    """A declared shape: each p2p instruction is one op (kind and peer as it says), each run one batch."""
    for s, r in enumerate(results):
        program = r["program"]
        p2p = [ins for ins in program if isinstance(ins, P2P)]
        assert [(kind, peer) for kind, peer, _ in net.log[s]] == [
            ("send" if isinstance(ins, SENDS) else "recv", ins.peer) for ins in p2p]
        assert [[("send" if isinstance(ins, SENDS) else "recv", ins.peer) for ins in program[a:b]]
                for a, b in p2p_runs(program)] == net.batches[s]


@pytest.mark.parametrize("tuples", [False, True], ids=["declared", "learned-tuple"])
@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)])
def test_batched_path_posts_each_run_of_transfers_as_one_batch(monkeypatch, schedule, chunks, p, tuples):
    net_a, blocking = run_pipeline(monkeypatch, schedule, p, chunks, False, tuples)
    net_b, batched = run_pipeline(monkeypatch, schedule, p, chunks, True, tuples)
    check_same_traffic(blocking, batched, net_a, net_b)
    if not tuples:
        check_one_op_per_instruction(batched, net_b)
    # learned shapes: one metadata message per boundary between virtual stages, each a batch alone
    metas = [e for s in range(p) for e in net_b.log[s] if _is_meta(e) and e[0] == "send"]
    assert len(metas) == (p * chunks - 1 if tuples else 0)
    losses = [x for r in batched for x in r["losses"]]
    assert len(losses) == M
    ref = reference_loss(tuples)
    # fp32: the micro-batches' mean loss in another summation order (the parity suites' 1e-5)
    assert abs(sum(losses) / M - ref) <= 1e-5 * abs(ref)


def test_batches_that_cover_most_of_1f1b_steady_state_pair_a_send_with_a_receive():
    """At pp=4, a middle stage's steady state batches 'send activation + receive gradient' and
    'send gradient + receive activation' (what Megatron's send_forward_recv_backward does)."""
    program = get_schedule("1f1b", 4, 8)[1]
    runs = [tuple(type(ins).__name__ for ins in program[a:b]) for a, b in p2p_runs(program)]
    assert ("SendAct", "RecvGrad") in runs and ("RecvAct", "SendGrad") in runs
    for a, b in p2p_runs(program):
        assert all(isinstance(ins, P2P) for ins in program[a:b])
        assert a == 0 or not isinstance(program[a - 1], P2P)
        assert b == len(program) or not isinstance(program[b], P2P)
    assert sum(b - a for a, b in p2p_runs(program)) == sum(isinstance(ins, P2P) for ins in program)


# -- the comm wrapper and the choice of path ----------------------------------------------------------

def test_batch_isend_irecv_counts_each_op_like_send_and_recv(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "P2POp", FakeP2POp)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: calls.append(ops) or ["work"])
    monkeypatch.setattr(dist, "send", lambda *a, **k: None)
    monkeypatch.setattr(dist, "recv", lambda *a, **k: None)
    pg = object()
    batch_stats, plain_stats = CommStats(), CommStats()
    a, b = torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(5)
    group = GroupHandle("pp", (4, 6), 0, pg, batch_stats)
    assert comm.batch_isend_irecv([PeerOp("send", a, 1), PeerOp("recv", b, 1)], group) == ["work"]
    (ops,) = calls
    assert [(op.op, op.peer, op.group) for op in ops] == [(dist.isend, 6, pg), (dist.irecv, 6, pg)]
    assert ops[0].tensor.data_ptr() == a.data_ptr() and ops[1].tensor is b
    plain = GroupHandle("pp", (4, 6), 0, pg, plain_stats)
    comm.send(a, 1, plain)
    comm.recv(b, 1, plain)
    assert batch_stats.snapshot() == plain_stats.snapshot() == {
        "pp/recv": {"calls": 1, "elements": 5.0, "bytes": 20.0, "inter_node_bytes": 0.0},
        "pp/send": {"calls": 1, "elements": 12.0, "bytes": 24.0, "inter_node_bytes": 0.0}}
    assert comm.batch_isend_irecv([], group) == [] and len(calls) == 1
    with pytest.raises(ValueError, match="'sned'"):
        PeerOp("sned", a, 1)


@pytest.mark.parametrize("name, device, batched", [
    ("nccl", "cuda", True), ("gloo", "cpu", False), ("gloo", "cuda", False),
    ("cpu:gloo,cuda:nccl", "cpu", False), ("cpu:gloo,cuda:nccl", "cuda:1", True)])
def test_the_pp_groups_backend_chooses_the_path(monkeypatch, name, device, batched):
    monkeypatch.setattr(dist, "get_backend", lambda pg: dist.Backend(name))
    group = GroupHandle("pp", (0, 1), 0, object(), CommStats())
    assert PipeP2P(group, (2,), torch.float32, device).batched is batched
    assert PipeP2P(group, (2,), torch.float32, device, batched=False).batched is False
    assert comm.backend_for_device(name, torch.device(device).type) == ("nccl" if batched else "gloo")


def test_a_group_without_a_process_group_is_blocking():
    assert comm.backend(single_rank_group("pp")) is None
    assert PipeP2P(single_rank_group("pp"), None, torch.float32).batched is False
    assert PipelineExecutor(None, None, FakeOptimizer(), 0, 1).batched is False


def test_a_failed_batch_names_all_of_its_instructions(monkeypatch):
    """Stage 1 of 2 alone: its batch of two receives waits for a stage 0 that never sends."""
    install(monkeypatch)
    net = FakeNet(1, timeout=0.3)
    group = GroupHandle("pp", (0, 1), 1, FakePG(1, net), CommStats())
    model = PipelineModule(layers(False), 2, 1, loss_fn, "uniform")
    ex = PipelineExecutor(model, PipeP2P(group, (MB, SEQ, HID), torch.float32, batched=True), FakeOptimizer(), 1, 2,
                          rank=3)
    program = parse_program("RA0<0 RG0<0")
    assert [type(ins) for ins in program] == [RecvAct, RecvGrad]
    with pytest.raises(PipelineError, match=r"stage 1 \(rank 3\) waiting at RecvAct mb 0 from stage 0, RecvGrad mb 0 "
                                            r"from stage 0 \(instructions 1-2 of 2\): TimeoutError"):
        ex.run(program, iter(()), 1)


def one_op_batches_worker():
    """Over a real gloo group: rank 0 sends then receives, rank 1 the reverse, each op a batch of its
    own (gloo has no coalescing: a batch of one is a single isend/irecv, which gloo runs safely)."""
    group = comm.world_group()
    other = 1 - group.rank
    mine = torch.arange(6, dtype=torch.float32).view(2, 3) + 10 * group.rank
    got = torch.empty(2, 3)
    steps = [PeerOp("send", mine, other), PeerOp("recv", got, other)]
    for op in steps if group.rank == 0 else steps[::-1]:
        for work in comm.batch_isend_irecv([op], group):
            work.wait()
    return got, group.stats.snapshot()


def test_batch_isend_irecv_runs_over_a_real_process_group():
    from tests.harness import run_ranks
    (got0, stats0), (got1, stats1) = run_ranks(one_op_batches_worker, 2, timeout=60)
    assert torch.equal(got0, torch.arange(6.0).view(2, 3) + 10) and torch.equal(got1, torch.arange(6.0).view(2, 3))
    assert stats0 == stats1 == {"world/recv": {"calls": 1, "elements": 6.0, "bytes": 24.0, "inter_node_bytes": 0.0},
                                "world/send": {"calls": 1, "elements": 6.0, "bytes": 24.0, "inter_node_bytes": 0.0}}
