"""The generated parity matrix (megazero/toolbox/parity_matrix.py): its generator, and every case of its
all-pairs covering set trained against the serial run (megazero/toolbox/parity.py says what is compared
and with which tolerance).

The generator tests are pure: the same seed gives the same cases, every pair of factor values that
some allowed case contains is covered, the pairs no case can contain are exactly the ones listed here
with their reason, and each of those is refused by the validation a user gets, with its message.
"""
import pytest

from megazero.core import pairwise
from megazero.toolbox import parity_matrix as pm
from megazero.toolbox.parity import compare, format_rows, merge_reports, run_layout, serial_key, serial_overrides
from tests.harness import run_ranks

STEPS = 2
ALLOWED = pairwise.Memo(pm.case_allowed, pm.FACTORS)  # one memo: the search and the covering set share validations
WITNESSES = pairwise.find_witnesses(pm.FACTORS, ALLOWED, seed=pm.SEED)  # once: ~59k cases validated
CASES = pm.pairwise_cases(witnesses=WITNESSES, allowed=ALLOWED)

# Every pair no allowed case contains, with the words of the user's error (or the world limit).
IMPOSSIBLE = {
    (("pp", 3), ("tp", 4)): "world size 12", (("pp", 4), ("tp", 4)): "world size 16",
    (("pp", 3), ("dp", 4)): "world size 12", (("pp", 4), ("dp", 4)): "world size 16",
    (("tp", 4), ("dp", 4)): "world size 16",
    (("pp", 1), ("schedule", "interleaved")): "needs num_stages >= 2",
    (("tp", 1), ("sequence_parallel", True)): "parallel.sequence_parallel: needs parallel.tp > 1",
    (("zero", 0), ("offload", "optimizer")): "zero.offload_optimizer.device: offloading the optimizer needs",
    (("zero", 0), ("offload", "optimizer+params")): "zero.offload_param.device: offloading parameters needs",
    (("zero", 1), ("offload", "optimizer+params")): "zero.offload_param.device: offloading parameters needs",
    (("zero", 2), ("offload", "optimizer+params")): "zero.offload_param.device: offloading parameters needs",
    (("schedule", "interleaved"), ("micro_batches", "1")): "train.gradient_accumulation_steps",
    (("checkpointing", "partitioned"), ("sequence_parallel", True)): "partition_activations: with parallel.seq",
    (("checkpointing", "partitioned+cpu"), ("sequence_parallel", True)): "partition_activations: with parallel.seq",
    (("precision", "bf16"), ("model", "moe")): "moe in bf16: routing is discrete",
    (("precision", "fp16"), ("model", "moe")): "moe in fp16: routing is discrete",
    (("ep", 2), ("precision", "bf16")): "parallel.ep=2: expert parallelism needs a Mixture-of-Experts model",
    (("ep", 2), ("precision", "fp16")): "parallel.ep=2: expert parallelism needs a Mixture-of-Experts model",
    (("dp", 1), ("ep", 2)): "parallel.ep=2 does not divide the data-parallel size dp=1",
    (("ep", 2), ("model", "gpt")): "parallel.ep=2: expert parallelism needs a Mixture-of-Experts model",
    (("ep", 2), ("model", "llama")): "parallel.ep=2: expert parallelism needs a Mixture-of-Experts model",
    (("ep", 2), ("sequence_parallel", True)): "parallel.ep=2: expert parallelism needs a Mixture-of-Experts model",
    (("sequence_parallel", True), ("model", "moe")): "parallel.sequence_parallel: not supported with model.moe",
    (("tp", 1), ("expert_tp", "1")): "expert_tp=1 at tp=1: the default layout",
    # context parallelism: the world limit, ulysses only at cp > 1, no dropout
    (("dp", 4), ("cp", 4)): "world size 16", (("pp", 3), ("cp", 4)): "world size 12",
    (("pp", 4), ("cp", 4)): "world size 16", (("tp", 4), ("cp", 4)): "world size 16",
    (("cp", 1), ("cp_method", "ulysses")): "cp_method=ulysses at cp=1: the default layout",
    (("cp", 2), ("dropout", 0.1)): "model.dropout: 0.1 with parallel.cp=2",
    (("cp", 4), ("dropout", 0.1)): "model.dropout: 0.1 with parallel.cp=4",
    (("cp_method", "ulysses"), ("dropout", 0.1)): "cp_method=ulysses at cp=1: the default layout",
}


@pytest.fixture(scope="module")
def witnesses():
    return WITNESSES


def test_covering_set_is_pure_and_covers_every_allowed_pair(witnesses):
    # pure: the same cases again (the memo only remembers case_allowed's answers, the generator draws again)
    assert pm.pairwise_cases(witnesses=witnesses, allowed=ALLOWED) == CASES
    covered = set().union(*(pairwise.pairs_in(c, pm.FACTORS) for c in CASES))
    allowed = {p for p, w in witnesses.items() if w is not None}
    assert allowed - covered == set()
    assert covered <= allowed
    assert all(pm.case_allowed(c) for c in CASES)
    lower_bound = max(len(a) * len(b) for a in pm.FACTORS.values() for b in pm.FACTORS.values() if a is not b)
    assert lower_bound <= len(CASES) <= 2 * lower_bound, len(CASES)


def test_impossible_pairs_are_the_listed_ones_and_refused_by_user_validation(witnesses):
    impossible = {p for p, w in witnesses.items() if w is None}
    assert impossible == set(IMPOSSIBLE), impossible ^ set(IMPOSSIBLE)
    defaults = {n: v[0] for n, v in pm.FACTORS.items()}
    for pair, words in IMPOSSIBLE.items():
        case = dict(defaults, **dict(pair))
        if case["schedule"] == "interleaved" and case["pp"] == 1 and pair[0][0] != "pp":
            case["pp"] = 2  # so that the pair itself, not interleaving at pp=1, is what is refused
        if case["ep"] > 1 and "dp" not in dict(pair):
            case["dp"] = 2  # likewise: not ep failing to divide dp=1
        if case["sequence_parallel"] and case["tp"] == 1 and "tp" not in dict(pair):
            case["tp"] = 2  # and not sequence parallelism at tp=1
        error = pm.case_error(case)
        assert error is not None and words in error, (pair, error)


def test_invalid_combinations_get_the_users_error():
    from megazero.core.config import ConfigError
    from megazero.engine import load_run_config

    bad = dict({n: v[0] for n, v in pm.FACTORS.items()}, zero=2, offload="optimizer+params", pp=2, dp=2)
    with pytest.raises(ConfigError, match="zero.offload_param.device") as err:
        load_run_config(pm.case_config(bad), world_size=4)
    assert pm.case_error(bad) == str(err.value)
    assert bad not in CASES


def test_generator_on_a_toy_product():
    factors = {"a": (0, 1, 2), "b": ("x", "y"), "c": (False, True), "d": (0, 1)}

    def allowed(case):  # c=True needs a > 0; a=2 excludes b=y
        return not (case["c"] and case["a"] == 0) and not (case["a"] == 2 and case["b"] == "y")
    cases = pairwise.covering_set(factors, allowed, seed=3)
    assert cases == pairwise.covering_set(factors, allowed, seed=3) and all(map(allowed, cases))
    witnesses = pairwise.find_witnesses(factors, allowed)
    assert {p for p, w in witnesses.items() if w is None} == {(("a", 0), ("c", True)), (("a", 2), ("b", "y"))}
    covered = set().union(*(pairwise.pairs_in(c, factors) for c in cases))
    assert covered == {p for p, w in witnesses.items() if w is not None}
    assert len(cases) < pairwise.product_size(factors)


_serial = {}


def serial_reference(cfg):
    """The serial run of `cfg`, shared by the cases whose serial configs are equal."""
    gb = cfg["train"]["global_batch_size"]
    key = serial_key(cfg, gb)
    if key not in _serial:
        _serial[key] = merge_reports(run_ranks(run_layout, 1, cfg, serial_overrides(gb), STEPS, timeout=300))
    return _serial[key]


@pytest.mark.parametrize("case", CASES, ids=[pm.case_name(c) for c in CASES])
def test_case_trains_like_one_process(case, corpus):
    cfg = pm.case_config(case, corpus)  # run_ranks turns the order check on in every rank
    world = pm.world_size(case)
    result = merge_reports(run_ranks(run_layout, world, cfg, (), STEPS, timeout=300))
    rows = compare(result, serial_reference(cfg))
    assert all(r["ok"] for r in rows), f"{pm.case_name(case)}\n{format_rows(rows)}"
