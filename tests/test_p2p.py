"""PipeP2P's shape handshake without processes: the metadata message round-trips, and what cannot
travel between stages (not one tensor, not floating point, too many dims) is refused with a message
naming the boundary, before anything is sent or cached."""
import pytest
import torch

from megazero.pipeline.p2p import MAX_DIMS, PipeP2P, _decode, _encode
from megazero.runtime.comm import single_rank_group


@pytest.mark.parametrize("shape, dtype", [((2, 8, 24), torch.float32), ((7,), torch.bfloat16),
                                          ((1,) * MAX_DIMS, torch.float16), ((3, 0, 5), torch.float64)])
def test_metadata_round_trips(shape, dtype):
    meta = _encode(shape, dtype, "cpu")
    assert meta.shape == (MAX_DIMS + 2,) and meta.dtype == torch.int64
    assert _decode(meta) == (shape, dtype)


def test_what_cannot_travel_is_refused_before_caching():
    p2p = PipeP2P(single_rank_group("pp"), None, torch.float32)
    with pytest.raises(TypeError, match="virtual stage 0 returned a tuple; .* must be one tensor"):
        p2p.send_activation((torch.zeros(2), torch.zeros(2)), peer=1, boundary=0)
    with pytest.raises(ValueError, match="dtype torch.int64 cannot carry gradients between stages"):
        p2p.send_activation(torch.zeros(2, dtype=torch.int64), peer=1, boundary=0)
    with pytest.raises(ValueError, match=f"at most {MAX_DIMS} dims"):
        p2p.send_activation(torch.zeros((1,) * (MAX_DIMS + 1)), peer=1, boundary=0)
    assert p2p.known == {}


def test_a_gradient_of_another_shape_names_its_direction():
    p2p = PipeP2P(single_rank_group("pp"), (2, 4), torch.float32)
    with pytest.raises(ValueError, match=r"pipeline gradient from virtual stage 3 back to 2 has shape \(2, 5\)"):
        p2p.send_grad(torch.zeros(2, 5), peer=0, boundary=2)
