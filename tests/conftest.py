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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and do not stall when the machine is busy)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--compiled", action="store_true",
                     help="run every decoder compiled: compile='auto' (the default) resolves to "
                          "True wherever exact mode allows (slow: seconds per graph on a CPU)")


@pytest.fixture(autouse=True)
def _compiled_everywhere(request, monkeypatch):
    """With --compiled, the losslessness tests run on the compiled verify."""
    if request.config.getoption("--compiled"):
        import dartree.compilation

        resolve = dartree.compilation.resolve_compile
        monkeypatch.setattr(dartree.compilation, "resolve_compile", lambda compile, exact: resolve(
            True if compile == "auto" and not exact else compile, exact))
