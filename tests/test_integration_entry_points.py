"""The serving engines find dartree's plug-ins through its installed metadata."""

import importlib.metadata
from pathlib import Path

import pytest

import dartree


def _this_checkout():
    """dartree's distribution, when it was installed from the checkout being tested."""
    try:
        dist = importlib.metadata.distribution("dartree")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("dartree is not installed (only on the path): no entry points to read")
    package = Path(dartree.__file__).resolve().parent
    origin = dist.locate_file("dartree").resolve() if dist.files else None
    editable = dist.read_text("direct_url.json") or ""
    if origin != package and str(package.parent) not in editable:
        pytest.skip("the installed dartree is another checkout")
    return dist


@pytest.mark.parametrize("group, value", [
    ("vllm.general_plugins", "dartree.integrations.vllm:register"),
    ("sglang.srt.plugins", "dartree.integrations.sglang:register")])
def test_plugin_entry_points_are_declared(group, value):
    points = [ep for ep in _this_checkout().entry_points if ep.group == group]
    assert [(ep.name, ep.value) for ep in points] == [("dartree", value)]
