"""What a result records about the machine and the models, and peak memory per call."""

from __future__ import annotations

import os
import platform
import sys

import torch

from ..target import TargetModel

def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else what `platform` knows)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def machine_info(device: torch.device, dtype: torch.dtype) -> dict:
    """CPU model, threads, library versions, device and dtype: recorded with every result."""
    from .. import __version__, ops

    info = dict(cpu=cpu_model(), cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, python=platform.python_version(), platform=platform.platform(),
                dartree=__version__, extension=ops.HAS_EXTENSION, cuda_kernels=ops.HAS_CUDA_KERNELS,
                device=str(device), dtype=str(dtype).removeprefix("torch."))
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    return info


def model_info(target, drafter) -> dict:
    model = target.model if isinstance(target, TargetModel) else target
    cfg = model.config
    info = dict(target=type(model).__name__, target_path=getattr(cfg, "_name_or_path", "") or None,
                target_params=model.num_parameters(),  # a packed model's weights included
                target_bytes=sum(t.numel() * t.element_size()
                                 for t in (*model.parameters(), *model.buffers())),
                target_packed=any(hasattr(m, "qtype") for m in model.modules()),
                target_layers=getattr(cfg, "num_hidden_layers", None),
                vocab_size=model.get_output_embeddings().out_features)
    if drafter is not None:
        info.update(drafter_path=str(drafter.path) if getattr(drafter, "path", None) else None,
                    drafter_params=sum(p.numel() for p in drafter.parameters()),
                    drafter_block_size=drafter.block_size, drafter_slots=drafter.num_slots,
                    drafter_head=drafter.head is not None,
                    draft_vocab=(None if getattr(drafter, "draft_vocab", None) is None
                                 else drafter.draft_vocab.numel()))
    return info


class PeakMemory:
    """Peak memory of one call: CUDA max_memory_allocated, else the process's peak RSS."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.kind = "cuda_max_memory_allocated" if self.cuda else "process_peak_rss"

    def start(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        import resource  # Unix only

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
