"""What a rank runs: code, libraries, device, serve config and behaviour-changing environment.

Ranks that differ in any of these can pick different kernels or collective algorithms and then
crash, hang or silently compute something else at the first collective. Every rank builds its
fingerprint before weights load; rank 0 compares them (distributed/handshake.py).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shardserve import envs
from shardserve.config import EngineConfig
from shardserve.kernels import cpu_features
from shardserve.version import __version__

# Variables that change what NCCL, gloo, CUDA, torch, oneDNN or shardserve do.
BEHAVIOUR_ENV_PREFIXES = ("NCCL_", "GLOO_", "CUDA_", "TORCH_", "SHARDSERVE_", "ONEDNN_", "DNNL_")
# Single variables that pick CPU kernels: torch's vector ISA and MKL's code path.
BEHAVIOUR_ENV_NAMES = frozenset({"ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR"})
# Variables naming this host's own interfaces or devices: their values may differ between nodes
# (eth0 here, ens3 there); only whether they are set is compared.
HOST_SPECIFIC_ENV = frozenset({"GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "CUDA_VISIBLE_DEVICES"})
SET = "<set>"
# Secrets: never published in a fingerprint (they would cross the network in the clear) nor compared
# here; the control token is checked by proof instead (distributed/control_token.py), and the API key
# matters only to rank 0's HTTP server.
SECRET_ENV = frozenset({envs.CONTROL_TOKEN.name, envs.API_KEY.name})
# Config fields that may differ between ranks without changing what they compute.
LOCAL_CONFIG_FIELDS = frozenset({"forward_env"})
UNSET = "<unset>"


@dataclass
class Fingerprint:
    rank: int
    host: str
    values: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"rank": self.rank, "host": self.host, "values": self.values}

    @classmethod
    def from_json(cls, data: dict) -> "Fingerprint":
        return cls(int(data["rank"]), str(data["host"]), dict(data["values"]))


@functools.cache
def source_digest() -> str:
    """sha256 over the package's source files (relative path and bytes), in path order."""
    root = Path(__file__).parent.parent  # the package
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def behaviour_env(forward_env: tuple[str, ...] = ()) -> dict[str, str]:
    names = {n for n in os.environ if n.startswith(BEHAVIOUR_ENV_PREFIXES) or n in BEHAVIOUR_ENV_NAMES}
    names |= set(forward_env)
    names -= SECRET_ENV
    return {name: os.environ.get(name, UNSET) for name in sorted(names)}


def _device_facts(device: str) -> dict[str, str]:
    if device == "cuda" and torch.cuda.is_available():
        return {"device.model": torch.cuda.get_device_name(torch.cuda.current_device()),
                "device.count": str(torch.cuda.device_count()),
                "cuda.version": str(torch.version.cuda),
                "nccl.version": ".".join(map(str, torch.cuda.nccl.version()))}
    # The instruction-set flags the kernel plan is decided from (kernels/cpu_features.py): two hosts with the
    # same model name can still differ (a VM that hides AVX-512 BF16, say).
    return {"device.model": _cpu_model(), "cpu.arch": platform.machine(),
            "cpu.features": cpu_features.detect().describe()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def collect(rank: int, config: EngineConfig) -> Fingerprint:
    values = {
        "shardserve.version": __version__,
        "shardserve.source_sha256": source_digest(),
        "python.version": platform.python_version(),
        "torch.version": torch.__version__,
        **_device_facts(config.device),
    }
    for f in dataclasses.fields(config):
        if f.name not in LOCAL_CONFIG_FIELDS:
            values[f"config.{f.name}"] = repr(getattr(config, f.name))
    for name, value in behaviour_env(tuple(config.forward_env)).items():
        values[f"env.{name}"] = SET if name in HOST_SPECIFIC_ENV and value != UNSET else value
    return Fingerprint(rank, socket.gethostname(), values)


def differences(prints: list[Fingerprint]) -> list[str]:
    """One line per key whose value is not the same on every rank, naming ranks, hosts and values."""
    lines = []
    keys = sorted({k for p in prints for k in p.values})
    for key in keys:
        by_value: dict[str, list[Fingerprint]] = {}
        for p in prints:
            by_value.setdefault(p.values.get(key, UNSET), []).append(p)
        if len(by_value) == 1:
            continue
        reference = prints[0].values.get(key, UNSET)
        groups = sorted(by_value.items(), key=lambda kv: (kv[0] != reference, kv[1][0].rank))
        described = "; ".join(
            f"{_ranks(ps)} {'has' if len(ps) == 1 else 'have'} {_show(value)}" for value, ps in groups)
        lines.append(f"{key.removeprefix('env.')} differs: {described}")
    return lines


def _ranks(prints: list[Fingerprint]) -> str:
    shown = ", ".join(f"rank {p.rank} ({p.host})" for p in prints[:4])
    return shown + (f" and {len(prints) - 4} more" if len(prints) > 4 else "")


def _show(value: str) -> str:
    return value if value in (UNSET, SET) else repr(value)
