"""Start-up work DeepSpeed does that Tessera's training never uses, skipped (measured per worker).

Pinned to DeepSpeed 0.19.8: the stand-ins replace internal modules, so an upgrade must rerun the
training tests (they exercise ZeRO-2 and ZeRO-3 through these paths).
"""

from __future__ import annotations

import sys
import types

_MUON_OPTIMIZER = "deepspeed.runtime.zero.muon.muon_optimizer"
_MUON_KERNELS = "deepspeed.runtime.zero.muon.original_muon"


def import_deepspeed():
    """``import deepspeed`` without the MLflow import that comes with it. DeepSpeed's autotuner
    module, imported by ``deepspeed.runtime.config``, does ``try: import mlflow`` for autotuning
    runs, which Tessera never starts: 0.85 s of every worker's start-up (measured with
    ``-X importtime``). Workers never log to MLflow; the driver does. While DeepSpeed imports,
    ``mlflow`` is marked absent (DeepSpeed then records ``has_mlflow = False``); afterwards a real
    ``import mlflow`` works as usual. A process that already imported MLflow keeps it."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide_mlflow = "mlflow" not in sys.modules
    if hide_mlflow:
        sys.modules["mlflow"] = None  # `import mlflow` raises ImportError
    try:
        import deepspeed
    finally:
        if hide_mlflow and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


def skip_unused_deepspeed_startup(use_gpu: bool) -> None:
    """Call after `import deepspeed`, before `deepspeed.initialize`."""
    _skip_muon_import()
    if not use_gpu:
        _skip_shm_comm_build()


def _skip_shm_comm_build() -> None:
    """DeepSpeed's CPU init JIT-compiles a shared-memory all-reduce op that only its inference path
    uses; a different `ninja` on PATH makes it recompile (25-45 s per run, measured). Training on
    CPU goes through gloo, so the build is skipped."""
    comm_torch = sys.modules.get("deepspeed.comm.torch")
    if comm_torch is not None and hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None


def _skip_muon_import() -> None:
    """ZeRO imports DeepSpeed's Muon optimizer in `initialize` and in every gradient reduction, only
    to test `isinstance(optimizer, MuonWithAuxAdam)`; importing it runs `torch.compile` decorators,
    which pull in Inductor: 1.0-1.1 s per worker start on CPU (measured). Tessera always builds a
    torch AdamW, so stand-ins answer those checks: nothing is an instance of the placeholder class,
    and the Muon update raises if DeepSpeed ever calls it. A run that already imported the real
    modules keeps them."""
    if _MUON_OPTIMIZER in sys.modules or _MUON_KERNELS in sys.modules:
        return
    optimizer_module = types.ModuleType(_MUON_OPTIMIZER, "Tessera stand-in: Muon is not used.")

    class MuonWithAuxAdam:  # never instantiated
        """Placeholder: `isinstance(torch AdamW, MuonWithAuxAdam)` is False, as it should be."""

    optimizer_module.MuonWithAuxAdam = MuonWithAuxAdam
    kernels_module = types.ModuleType(_MUON_KERNELS, "Tessera stand-in: Muon is not used.")

    def muon_update(*args, **kwargs):
        raise NotImplementedError("Tessera replaced DeepSpeed's Muon kernels at start-up: Muon is not supported")

    kernels_module.muon_update = muon_update
    sys.modules[_MUON_OPTIMIZER] = optimizer_module
    sys.modules[_MUON_KERNELS] = kernels_module
