"""Which of vLLM 0.30's CPU kernel paths the project's vLLM set-ups let it take, on any x86-64 CPU.

vLLM's CPU backend picks kernels by one probe, `torch.cpu._is_amx_tile_supported()` (CPUID and XCR0, through
torch's cpuinfo: Intel Xeon 4th gen and later). Where it says yes (and the dtype is bf16), vLLM runs its own
AMX kernels: the attention kernel (block sizes that are multiples of 32), the grouped-gemm MoE experts, the
sgl-kernels linear layers and the AMX_MLA attention backend. Two of those broke the suite on such a Xeon
(issue 30 item 0) while it passes on AMD EPYC (AVX-512, no AMX), where the probe says no:

- AMX_MLA and weight sync. With AMX_MLA, `MLAAttention.process_weights_after_loading` packs W_UK/W_UV for the
  AMX bmm and then replaces `kv_b_proj.weight` by an empty parameter. vLLM's reload (`sync_weights`) restores
  the layer on the meta device, loads the new (heads * (nope + v), kv_lora_rank) weight and copies it back
  into the kernel tensor it saved, the empty one: "The size of tensor a (0) must match the size of tensor b
  (512) at non-singleton dimension 1". `choose` asks vLLM for its reference `CPU_MLA` backend for every MLA
  model (`attention_backend`), which is what every CPU without AMX runs already: the same kernels on every
  CPU, block size 16, weights kept, and a reload that recomputes W_UK/W_UV (tested here with the probe
  forced, where the unforced choice reproduces the error).
- AMX tiles need a per-process permission. Linux (5.16+) runs tile instructions only in a process that asked
  for them (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`); without it the first one raises SIGILL.
  In vLLM's CPU library only oneDNN asks (`dnnl::impl::cpu::x64::amx::is_available`, when its AMX brgemm first
  runs; the sgl-kernels linear uses brgemm only for more than 4 rows). vLLM's own AMX attention and MoE
  kernels never ask, so a worker whose first forward has at most 4 tokens (a 3-token prompt) dies with
  exit code -4. `ONEDNN_MAX_CPU_ISA` cannot help: those kernels are not oneDNN's, and no vLLM 0.30 switch turns
  them off. `amx_tiles` asks for the permission in the calling process before vLLM runs anything there:
  `VLLMEngine` calls it (the in-process engine), and so does the routereplay vLLM plugin, which vLLM runs in
  every process it starts (API server, engine core, each worker). Where the CPU has AMX and Linux refuses
  (a kernel before 5.16, a sandbox that filters arch_prctl), `AmxPermissionError` is raised instead of the
  SIGILL. On a CPU without AMX nothing is asked (`AmxTiles.ABSENT`): vLLM never picks an AMX kernel there.

`CpuKernels` records both choices for one engine (`VLLMEngine.cpu_kernels`), so what ran is never implicit.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
from dataclasses import dataclass
from typing import Any

from routereplay.enums import StrEnum
from routereplay.errors import AmxPermissionError

SYS_ARCH_PRCTL = 158  # x86-64 system call number of arch_prctl
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18  # the AMX tile-data state component
MLA_BACKEND = "CPU_MLA"  # vLLM's reference MLA backend: keeps kv_b_proj.weight, so a reload can load into it


class AmxTiles(StrEnum):
    """Whether this process can run vLLM's AMX kernels."""

    ABSENT = "absent"  # vLLM's probe sees no AMX: it never picks an AMX kernel
    GRANTED = "granted"  # AMX, and Linux granted this process the tile permission


def vllm_sees_amx() -> bool:
    """What vLLM 0.30's CPU backend decides its AMX paths by: x86-64 and `torch.cpu._is_amx_tile_supported()`."""
    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and bool(torch.cpu._is_amx_tile_supported())


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def request_tile_data() -> int:
    """Ask Linux for this process's AMX tile-data permission: 0 if granted, else the errno of the refusal."""
    request, feature = ctypes.c_long(ARCH_REQ_XCOMP_PERM), ctypes.c_long(XFEATURE_XTILEDATA)
    result = _libc().syscall(ctypes.c_long(SYS_ARCH_PRCTL), request, feature)
    return 0 if result == 0 else ctypes.get_errno()


def tile_data_permitted() -> bool:
    """Whether this process holds the AMX tile-data permission (`ARCH_GET_XCOMP_PERM`)."""
    mask = ctypes.c_ulong(0)
    result = _libc().syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_PERM), ctypes.byref(mask))
    return result == 0 and bool(mask.value & (1 << XFEATURE_XTILEDATA))


def amx_tiles(where: str) -> AmxTiles:
    """Make this process safe for vLLM's AMX kernels: ask for the tile permission where vLLM will use them.

    `AmxPermissionError` (naming `where`) where the CPU has AMX and Linux refuses the permission."""
    if not vllm_sees_amx():
        return AmxTiles.ABSENT
    if not sys.platform.startswith("linux"):  # the permission is Linux's; vLLM's CPU backend runs on Linux
        return AmxTiles.GRANTED
    code = request_tile_data()
    if code == 0 and tile_data_permitted():
        return AmxTiles.GRANTED
    reason = os.strerror(code) if code else "granted, yet ARCH_GET_XCOMP_PERM does not list it"
    raise AmxPermissionError(
        f"{where}: this CPU has AMX, so vLLM 0.30's CPU backend runs its AMX kernels (attention, MoE experts, "
        f"MLA), but Linux refused process {os.getpid()} the AMX tile permission (arch_prctl(ARCH_REQ_XCOMP_PERM, "
        f"XFEATURE_XTILEDATA): {reason}); the first tile instruction would kill it with SIGILL (exit code -4). "
        "vLLM 0.30 has no switch that turns those kernels off (ONEDNN_MAX_CPU_ISA covers oneDNN only): run on "
        "Linux >= 5.16 outside any sandbox that filters arch_prctl, or on a CPU without AMX"
    )


def mla_backend(config: Any) -> str | None:
    """The attention backend the engine asks vLLM for: `MLA_BACKEND` for an MLA model, else None (vLLM's)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return MLA_BACKEND if getattr(text, "kv_lora_rank", None) else None


@dataclass(frozen=True, slots=True)
class CpuKernels:
    """What one engine let vLLM's CPU backend do: AMX tiles (`AmxTiles`) and the attention backend it asked
    for (None: vLLM's own choice)."""

    amx: AmxTiles
    attention_backend: str | None

    def llm_kwargs(self) -> dict[str, Any]:
        """The `vllm.LLM` arguments these choices add."""
        return {} if self.attention_backend is None else {"attention_backend": self.attention_backend}


def choose(config: Any, *, where: str) -> CpuKernels:
    """The CPU kernel choices for a model (its HF config), this process made safe for them first."""
    return CpuKernels(amx_tiles(where), mla_backend(config))


__all__ = [
    "ARCH_GET_XCOMP_PERM",
    "ARCH_REQ_XCOMP_PERM",
    "MLA_BACKEND",
    "SYS_ARCH_PRCTL",
    "XFEATURE_XTILEDATA",
    "AmxTiles",
    "CpuKernels",
    "amx_tiles",
    "choose",
    "mla_backend",
    "request_tile_data",
    "tile_data_permitted",
    "vllm_sees_amx",
]
