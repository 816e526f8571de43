import os
import sys

# tests import the package from the checkout even without an install
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest

# every multi-rank run of the suite (run_ranks, torchrun subprocesses, the parity matrix) checks that the
# members of each group issue the same collectives in the same order (megazero/runtime/order_check.py)
os.environ.setdefault("MEGAZERO_VERIFY_ORDER", "1")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small real-text corpus (a slice of the Python standard library, byte tokens, vocab 257)."""
    from megazero.data import demo_corpus, preprocess

    prefix = str(tmp_path_factory.mktemp("corpus") / "stdlib")
    preprocess(lambda: demo_corpus(300_000), prefix)
    return prefix
