"""Check that every CUDA kernel of the debug build fits the launch it gets.

A kernel launched with more threads than its registers allow fails at launch ("too many resources
requested"), and a debug build (DARTREE_DEBUG=1: -O0 -G) needs far more registers than -O3. This
compiles the device code of each csrc/cuda/*.cu with setup.py's nvcc flags plus `-Xptxas -v`
(device code only, `--fatbin`: no host compile, no link, no GPU), reads each kernel's register
count from ptxas and its `.maxntid` (its __launch_bounds__) from the PTX, and fails when

  - a kernel has no __launch_bounds__ (then nothing ties its registers to its launch), or
  - its registers, rounded up to the allocation unit of 8 a thread, times its maximum threads
    exceed the 65536 registers of a block (sm_80 / sm_90).

The launchers launch with the constant named in each kernel's bound, so the bound is the launch.

  python scripts/check_cuda_registers.py            # debug flags (the CI check)
  python scripts/check_cuda_registers.py --release  # the -O3 build, for comparison
Environment: NVCC (default $CUDA_HOME/bin/nvcc, else nvcc on PATH), TORCH_CUDA_ARCH_LIST
(default "8.0;9.0").
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGS_PER_BLOCK = 65536  # sm_80 and sm_90
REG_UNIT = 8  # registers are allocated per thread in multiples of 8 (256 per warp)


def nvcc_flags(debug):
    """The nvcc flags setup.py gives a .cu file (keep in step with setup.py::_extensions)."""
    from torch.utils import cpp_extension

    archs = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    gencode = []
    for arch in re.split(r"[;\s]+", archs.strip()):
        num = arch.replace(".", "").replace("+PTX", "")
        gencode.append(f"-gencode=arch=compute_{num},code=sm_{num}")
    includes = [os.path.join(ROOT, "csrc"), os.path.join(ROOT, "csrc", "include")]
    includes += cpp_extension.include_paths("cuda") + [sysconfig.get_paths()["include"]]
    return ([f"-I{d}" for d in includes] + cpp_extension.COMMON_NVCC_FLAGS
            + (["-O0", "-g", "-G"] if debug else ["-O3"])
            + ["-lineinfo", "--expt-relaxed-constexpr", "-DWITH_CUDA", "-std=c++20",
               "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C"] + gencode)


def demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    return dict(zip(names, out))


def max_threads(ptx_files):
    """{mangled kernel: .maxntid threads, or None without a bound} from the kept PTX."""
    bounds = {}
    for path in ptx_files:
        text = open(path).read()
        entry = r"\.entry\s+(\S+)\s*\((.*?)\)\s*(\.maxntid\s+(\d+),\s*(\d+),\s*(\d+))?"
        for m in re.finditer(entry, text, re.DOTALL):
            bounds[m.group(1)] = (int(m.group(4)) * int(m.group(5)) * int(m.group(6))
                                  if m.group(3) else None)
    return bounds


def compile_one(nvcc, source, flags, workdir):
    """[(mangled kernel, sm, registers, spill store bytes)], {mangled: max threads} of one .cu."""
    keep = os.path.join(workdir, os.path.basename(source))
    os.makedirs(keep)
    cmd = [nvcc, "--fatbin", source, "-o", os.path.join(keep, "out.fatbin"), "-Xptxas", "-v",
           "-keep", f"-keep-dir={keep}"] + flags
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"nvcc failed on {source}:\n{run.stdout}{run.stderr}")
    usage, kernel, sm, spill = [], None, None, 0
    for line in (run.stdout + run.stderr).splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\d+)'", line)
        if m:
            kernel, sm, spill = m.group(1), m.group(2), 0
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m:
            spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and kernel is not None:
            usage.append((kernel, sm, int(m.group(1)), spill))
            kernel = None
    return usage, max_threads(glob.glob(os.path.join(keep, "*.ptx")))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="store_true", help="-O3 flags instead of -O0 -g -G")
    args = parser.parse_args()
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.environ.get("NVCC") or (os.path.join(home, "bin", "nvcc") if home else "nvcc")
    flags = nvcc_flags(debug=not args.release)
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    start = time.perf_counter()
    rows, failures = [], []
    with tempfile.TemporaryDirectory() as workdir:
        for source in sources:  # one nvcc at a time: each needs ~1.5 GB
            usage, bounds = compile_one(nvcc, source, flags, workdir)
            if not usage:
                failures.append(f"{os.path.basename(source)}: ptxas reported no kernels")
            names = demangle(sorted({k for k, _, _, _ in usage}))
            for kernel, sm, regs, spill in usage:
                name = names[kernel].split("(")[0].removeprefix("void ").removeprefix("dartree::")
                threads = bounds.get(kernel)
                need = -(-regs // REG_UNIT) * REG_UNIT * threads if threads else None
                rows.append((os.path.basename(source), sm, regs, spill, threads, need, name))
                if threads is None:
                    failures.append(f"{name} ({sm}, {regs} registers): no __launch_bounds__")
                elif need > REGS_PER_BLOCK:
                    failures.append(f"{name} ({sm}): {regs} registers x {threads} threads "
                                    f"needs {need} > {REGS_PER_BLOCK} a block")
    wall = time.perf_counter() - start
    line = "{:<18} {:<6} {:>4} {:>7} {:>7} {:>10}  {}"
    print(line.format("file", "sm", "regs", "spill B", "threads", "regs/block", "kernel"))
    rows.sort(key=lambda r: (r[0], r[6], r[1]))  # by file, kernel, sm
    for file, sm, regs, spill, threads, need, name in rows:
        print(line.format(file, sm, regs, spill, threads or "-", need or "-", name))
    build = "release (-O3)" if args.release else "debug (-O0 -g -G)"
    print(f"{len(rows)} kernels, {build}, {len(sources)} files compiled in {wall:.0f} s")
    if failures:
        print("FAIL: kernels that cannot launch as configured:\n  " + "\n  ".join(failures))
        return 1
    print("OK: every kernel fits its launch bounds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
