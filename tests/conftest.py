import pytest
import torch

import dartree.ops

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def native():
    """Tests of compiled kernels need the extension; say so instead of testing the fallback."""
    if not dartree.ops.HAS_EXTENSION:
        pytest.fail("dartree._C is not built: run `pip install --no-build-isolation -e .`")
