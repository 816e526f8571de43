"""setup.py's lowest torch must have every torch API megazero calls unguarded.

Each row: a call written in megazero's source, and the torch release that introduced it. A newer API
used only behind a `hasattr` check (torch._grouped_mm) is not listed."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
INTRODUCED = {  # what megazero's source contains -> the torch version that has it
    "enable_gqa=": (2, 5),  # scaled_dot_product_attention's grouped-query attention
    "F.rms_norm": (2, 4),
    "torch._foreach_norm(": (2, 4),  # its dtype= argument
    "device_id=": (2, 3),  # init_process_group(device_id=...)
    "torch.nn.attention": (2, 3),
    "nonzero_static": (2, 1),
}


def _minimum() -> tuple[int, int]:
    text = (ROOT / "setup.py").read_text()
    major, minor = re.search(r'"torch>=(\d+)\.(\d+)"', text).groups()
    return int(major), int(minor)


def test_setup_asks_for_a_torch_with_every_api_megazero_calls():
    source = "\n".join(p.read_text() for p in (ROOT / "megazero").rglob("*.py"))
    used = {api: version for api, version in INTRODUCED.items() if api in source}
    assert "enable_gqa=" in used
    too_new = {api: version for api, version in used.items() if version > _minimum()}
    assert not too_new, f"setup.py asks for torch>={_minimum()}, but megazero calls {too_new}"
