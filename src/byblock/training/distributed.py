"""Where a training process runs: its device (one GPU per local rank under torchrun) and its process group
(NCCL on GPUs, gloo on CPUs)."""

from __future__ import annotations

import os

import torch


def world(device: torch.device) -> tuple[int, int]:
    """(rank, world size); joins the process group on first use under torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def process_device(device: str | torch.device) -> torch.device:
    """This process's device: under torchrun on CUDA, the GPU of its local rank."""
    from byblock.models.devices import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev
