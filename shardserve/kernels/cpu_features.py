"""What this CPU can compute fast, from its instruction-set flags (not from whether a library loads).

The question that matters is whether bfloat16 matmuls run natively: AVX-512 BF16 (`avx512_bf16`) or AMX
(`amx_bf16`). oneDNN also runs bfloat16 on plain AVX-512 parts, by emulation: slower, and rounded
differently from the native path, so it is never chosen by default. `ONEDNN_MAX_CPU_ISA` (or
`DNNL_MAX_CPU_ISA`) caps what oneDNN may use; a cap below the bfloat16 instructions counts as their
absence, exactly as oneDNN will behave.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from shardserve import envs

# The flags read from /proc/cpuinfo (Linux names), in the order they are described.
FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "amx_bf16")
ISA_CAP_ENV = (envs.ONEDNN_MAX_CPU_ISA.name, envs.DNNL_MAX_CPU_ISA.name)


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]
    isa_cap: str | None = None  # ONEDNN_MAX_CPU_ISA as set, upper case

    @property
    def avx2_fma(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def fast_bfloat16(self) -> bool:
        """Native bfloat16 dot products that oneDNN is allowed to use."""
        native = "avx512_bf16" in self.flags or {"amx_tile", "amx_bf16"} <= self.flags
        return native and _cap_allows_bfloat16(self.isa_cap)

    def describe(self) -> str:
        shown = " ".join(f for f in FLAGS if f in self.flags) or "none of " + "/".join(FLAGS)
        cap = f", oneDNN capped at {self.isa_cap}" if self.isa_cap else ""
        return f"{shown}{cap} (bfloat16 {'native' if self.fast_bfloat16 else 'not native'})"


def _cap_allows_bfloat16(cap: str | None) -> bool:
    if cap is None or cap in ("ALL", "DEFAULT", ""):
        return True
    # oneDNN's ISA names with bfloat16 dot products: AVX512_CORE_BF16, AVX512_CORE_FP16 (a superset),
    # AVX512_CORE_AMX*, AVX10_*.
    return "BF16" in cap or "AMX" in cap or cap.startswith("AVX10") or cap == "AVX512_CORE_FP16"


def parse_cpuinfo_flags(text: str) -> frozenset[str]:
    """The flags of the first processor in a /proc/cpuinfo text."""
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _torch_flags() -> frozenset[str]:
    """Where /proc/cpuinfo is not there: torch's own cpuinfo-based checks."""
    import torch

    probes = {"avx2": "_is_avx2_supported", "avx512f": "_is_avx512_supported",
              "avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}
    found = set()
    for flag, name in probes.items():
        probe = getattr(torch.cpu, name, None)
        if probe is not None and probe():
            found.add(flag)
    if "avx2" in found:
        found.add("fma")  # every AVX2 part torch targets has FMA3
    if "amx_tile" in found:
        found.add("amx_bf16")
    return frozenset(found)


def read_flags() -> frozenset[str]:
    try:
        flags = parse_cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    return flags if flags else _torch_flags()


@functools.cache
def _detect_cached(cap: str | None) -> CpuFeatures:
    return CpuFeatures(frozenset(f for f in read_flags() if f in FLAGS), cap)


def detect() -> CpuFeatures:
    """This CPU's features, with the oneDNN ISA cap currently in the environment."""
    cap = next((v.strip().upper() for v in (envs.ONEDNN_MAX_CPU_ISA.get(), envs.DNNL_MAX_CPU_ISA.get()) if v), None)
    return _detect_cached(cap)
