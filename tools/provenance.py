"""Where a benchmark result came from: the checkout's sha and the machine it ran on."""

from __future__ import annotations

import os
import platform
import subprocess

import torch


def git_sha() -> str:
    """Short sha of this checkout, ``-dirty`` when it has uncommitted changes."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, check=False,
                                  cwd=os.path.dirname(os.path.abspath(__file__)))
        except OSError:
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    sha = git("rev-parse", "--short", "HEAD")
    if sha is None:
        return "unknown (no git checkout)"
    return sha + ("-dirty" if git("status", "--porcelain") else "")


def machine(device: str) -> str:
    """Accelerator (or CPU), CPU model, cores, threads and torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    where = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    return (f"{where}; {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}")
