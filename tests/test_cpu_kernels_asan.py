"""The torch-free CPU draft-tree kernels (csrc/include/dartree/cpu/*.h), built under AddressSanitizer and
UndefinedBehaviorSanitizer and checked against naive loops (tests/cpp/tree_kernels_test.cpp): an
out-of-bounds access in a kernel fails here even when it would not crash the extension."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_tree_kernels_under_asan(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    binary = tmp_path / "tree_kernels_test"
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-omit-frame-pointer",
         "-fno-sanitize-recover=all", "-I", os.path.join(ROOT, "csrc", "include"),
         os.path.join(ROOT, "tests", "cpp", "tree_kernels_test.cpp"), "-o", str(binary)],
        capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"the compiler cannot build with sanitizers: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr[-3000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, ASAN_OPTIONS="detect_leaks=0"))
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-3000:] + run.stderr[-3000:]
