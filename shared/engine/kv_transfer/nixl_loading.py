"""Loading NIXL: the wheel built for torch's CUDA major version, and the environment variables to
set before torch is imported and any agent exists."""
from __future__ import annotations

import importlib
import sys

from shared.engine.kv_transfer.transfer import KvTransferError


def recommended_environment(*, uses_cuda: bool) -> dict[str, str]:
    """Variables to set before torch is imported and any agent exists (both read them once)."""
    environment = {"THP_MEM_ALLOC_ENABLE": "1"}  # torch puts large CPU tensors on huge pages
    if uses_cuda:
        # UCX disables cuda_ipc READs between processes unless NVLink is detected, then falls back
        # to TCP: on one H200 that was 0.5 GB/s instead of 125 GB/s for 128 MiB.
        environment["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = "y"
    return environment


def nixl_module_names(torch_cuda_version: str | None) -> tuple[str, ...]:
    """NIXL's import names, the one built for torch's CUDA major version first.

    The wheels are named after the CUDA major version they were built for (nixl-cu12 imports as
    nixl_cu12, nixl-cu13 as nixl_cu13); the API is the same. A CPU torch (version None) takes either.
    """
    if torch_cuda_version and torch_cuda_version.split(".")[0] == "13":
        return "nixl_cu13", "nixl_cu12"
    return "nixl_cu12", "nixl_cu13"


def nixl_api():
    # Imported lazily so that importing this module stays cheap and torch-free: torch's CUDA version
    # is read only if the caller already imported torch (an engine always has).
    torch_module = sys.modules.get("torch")
    torch_cuda_version = getattr(getattr(torch_module, "version", None), "cuda", None)
    for module_name in nixl_module_names(torch_cuda_version):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        return module.nixl_agent, module.nixl_agent_config
    raise KvTransferError("NIXL is not installed (pip install nixl-cu12 or nixl-cu13)")
