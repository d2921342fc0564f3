import pytest
import torch

from dsv4_idxk_probe.digest import get_layout

LAYOUT_NAMES = ("fp8", "fp4", "bf16")


@pytest.fixture(params=LAYOUT_NAMES)
def layout(request):
    return get_layout(request.param)


def _random_buffers(layout, n_layers: int, n_pages: int, seed: int) -> list[torch.Tensor]:
    """Per-layer uint8 [pages, row_bytes] buffers of random bytes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n_pages, layout.row_bytes), dtype=torch.uint8, generator=g) for _ in range(n_layers)]


@pytest.fixture
def random_buffers():
    return _random_buffers
