"""PipeP2P's handshake without processes: the metadata message round-trips (one tensor or a tuple of
up to MAX_TENSORS, floating point or integer/bool), and what cannot travel between stages (not a
tensor or a tuple of tensors, an unsupported dtype, too many dims or tensors) is refused with a
message naming the boundary, before anything is sent or cached."""
import pytest
import torch

from megazero.pipeline.p2p import ENTRY, MAX_DIMS, MAX_TENSORS, PipeP2P, _decode, _encode
from megazero.runtime.comm import single_rank_group


@pytest.mark.parametrize("metas, is_tuple", [
    ([((2, 8, 24), torch.float32)], False), ([((7,), torch.bfloat16)], False),
    ([((1,) * MAX_DIMS, torch.float16)], False), ([((3, 0, 5), torch.float64)], False),
    ([((2, 8, 24), torch.float32), ((2, 8), torch.bool), ((2, 8), torch.int64)], True),
    ([((4,), torch.uint8)] * MAX_TENSORS, True)])
def test_metadata_round_trips(metas, is_tuple):
    meta = _encode(metas, is_tuple, "cpu")
    assert meta.shape == (2 + MAX_TENSORS * ENTRY,) and meta.dtype == torch.int64
    assert _decode(meta) == (tuple(metas), is_tuple)


def test_what_cannot_travel_is_refused_before_caching():
    p2p = PipeP2P(single_rank_group("pp"), None, torch.float32)
    with pytest.raises(TypeError, match="virtual stage 0 returned a dict; .* must be a tensor or a tuple of tensors"):
        p2p.send_activation({"h": torch.zeros(2)}, peer=1, boundary=0)
    with pytest.raises(TypeError, match="virtual stage 0 returned a tuple of Tensor, int"):
        p2p.send_activation((torch.zeros(2), 3), peer=1, boundary=0)
    with pytest.raises(ValueError, match="dtype torch.complex64 cannot pass between stages"):
        p2p.send_activation(torch.zeros(2, dtype=torch.complex64), peer=1, boundary=0)
    with pytest.raises(ValueError, match=f"at most {MAX_DIMS} dims"):
        p2p.send_activation(torch.zeros((1,) * (MAX_DIMS + 1)), peer=1, boundary=0)
    with pytest.raises(ValueError, match=f"tuple of {MAX_TENSORS + 1} tensors; between 1 and {MAX_TENSORS}"):
        p2p.send_activation((torch.zeros(1),) * (MAX_TENSORS + 1), peer=1, boundary=0)
    assert p2p.known == {}


def test_a_declared_shape_takes_one_tensor():
    p2p = PipeP2P(single_rank_group("pp"), (2, 4), torch.float32)
    with pytest.raises(TypeError, match=r"returned a tuple, but this model declares one activation of shape \(2, 4\)"):
        p2p.send_activation((torch.zeros(2, 4), torch.zeros(2, 4)), peer=1, boundary=0)


def test_a_gradient_of_another_shape_names_its_direction():
    p2p = PipeP2P(single_rank_group("pp"), (2, 4), torch.float32)
    with pytest.raises(ValueError, match=r"pipeline gradient from virtual stage 3 back to 2 has shape \(2, 5\)"):
        p2p.send_grad(torch.zeros(2, 5), peer=0, boundary=2)
