"""Build dartree and its C++/CUDA extension dartree._C.

The C++ CPU kernels are always built. The CUDA kernels are built whenever torch is a CUDA build and
a CUDA toolkit is found -- a GPU is not needed to compile them. Switches (environment):

  DARTREE_CPU_ONLY=1     never build the CUDA kernels
  DARTREE_FORCE_CUDA=1   fail unless the CUDA kernels are built
  CUDA_HOME / CUDA_PATH  the toolkit root (otherwise asked of the nvcc on PATH)
  TORCH_CUDA_ARCH_LIST   GPU architectures (default "8.0;9.0")
  MAX_JOBS               parallel compile jobs (default 1: a torch .cu needs ~1.5 GB)
  DARTREE_DEBUG=1        -O0 -g; DARTREE_ASAN=1 adds AddressSanitizer to the C++ CPU kernels
"""

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _find_cuda_home():
    """The toolkit root: $CUDA_HOME/$CUDA_PATH, else where the real nvcc says it lives.

    nvcc on PATH may be a wrapper script, so resolving its path is not enough; `nvcc -dryrun`
    prints the directory of the real binary (`#$ _HERE_=<root>/bin`).
    """
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        out = subprocess.run([nvcc, "-dryrun", "-c", "x.cu"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ _HERE_=(.+)$", out.stdout + out.stderr, re.MULTILINE)
    return os.path.dirname(match.group(1).strip()) if match else None


def _want_cuda():
    if _flag("DARTREE_CPU_ONLY"):
        return None
    import torch

    home = _find_cuda_home()
    ok = torch.version.cuda is not None and home is not None and os.path.exists(
        os.path.join(home, "include", "cuda_runtime.h"))
    if not ok:
        why = ("torch is a CPU-only build" if torch.version.cuda is None else
               "no CUDA toolkit found (set CUDA_HOME)")
        if _flag("DARTREE_FORCE_CUDA"):
            sys.exit(f"DARTREE_FORCE_CUDA=1 but the CUDA kernels cannot be built: {why}")
        print(f"dartree: building CPU kernels only ({why})")
        return None
    return home


def _extensions():
    cuda_home = _want_cuda()
    if cuda_home is not None:
        # cpp_extension reads CUDA_HOME when imported; its own guess is wrong behind a wrapper.
        os.environ["CUDA_HOME"] = cuda_home
    from torch.utils import cpp_extension

    if cuda_home is not None:
        cpp_extension.CUDA_HOME = cuda_home
    os.environ.setdefault("MAX_JOBS", "1")

    debug, asan = _flag("DARTREE_DEBUG"), _flag("DARTREE_ASAN")
    cxx = ["-O0", "-g"] if debug else ["-O3"]
    link = []
    if sys.platform.startswith("linux"):
        # at::parallel_for runs on OpenMP only when the extension itself is compiled with it;
        # without the flag every CPU kernel would run on one thread.
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if asan:
        cxx += ["-fsanitize=address", "-fno-omit-frame-pointer"]
        link += ["-fsanitize=address"]
    sources = ["csrc/ops.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    include_dirs = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    kwargs = dict(extra_compile_args={"cxx": cxx}, extra_link_args=link,
                  include_dirs=include_dirs)
    if cuda_home is None:
        return [cpp_extension.CppExtension("dartree._C", sources, **kwargs)], cpp_extension

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    gencode = []
    for arch in re.split(r"[;\s]+", archs.strip()):
        num = arch.replace(".", "").replace("+PTX", "")
        gencode.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    kwargs["extra_compile_args"]["nvcc"] = (["-O0", "-g", "-G"] if debug else ["-O3"]) + [
        "-lineinfo", "--expt-relaxed-constexpr", "-DWITH_CUDA"] + gencode
    kwargs["extra_compile_args"]["cxx"].append("-DWITH_CUDA")
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    print(f"dartree: building CPU and CUDA kernels (toolkit {cuda_home}, archs {archs})")
    return [cpp_extension.CUDAExtension("dartree._C", sources, **kwargs)], cpp_extension


def _build_config():
    # `egg_info`/`--help` need no compiler; every build command gets the extension.
    if any(cmd in sys.argv for cmd in ("egg_info", "--help", "clean", "sdist", "dist_info")):
        return {}
    extensions, cpp_extension = _extensions()
    return dict(ext_modules=extensions,
                cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)})


setup(
    name="dartree",
    version="0.1.0",
    description="Lossless speculative decoding with block-diffusion drafters and draft trees",
    packages=find_packages(include=["dartree", "dartree.*"]),
    package_data={"dartree": ["models/**/*"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.11", "transformers>=5.17", "safetensors", "numpy"],
    # serve: `dartree serve` (dartree/serve/); test: the serve tests' client and Starlette's
    # TestClient transport
    extras_require={"serve": ["starlette==1.10.0", "uvicorn==0.54.0"],
                    "test": ["pytest", "openai==3.51.0", "httpx2==2.17.0"]},
    entry_points={
        "console_scripts": ["dartree = dartree.cli:main"],
        # serving engines load these in every process they start (dartree/integrations/)
        "vllm.general_plugins": ["dartree = dartree.integrations.vllm:register"],
        "sglang.srt.plugins": ["dartree = dartree.integrations.sglang:register"],
    },
    **_build_config(),
)
