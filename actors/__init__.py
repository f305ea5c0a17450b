"""The three actor kinds: HostShard (owns host segments), OptimizerWorker (CPU AdamW), GPUWorker
(the layer stream). Plain classes: `megatrain_ray.driver.runtime.spawn` runs them as Ray actors or in-process.

Each is imported from its own module when first asked for: an actor's process imports only its own kind's
module (a HostShard or an OptimizerWorker not the layer stream's, about 0.1 to 0.2 s less per process)."""

from __future__ import annotations

import importlib
from typing import Any

_MODULES = {"GPUWorker": "actors.gpu_worker", "HostShard": "actors.host_shard",
            "OptimizerWorker": "actors.optimizer_worker"}

__all__ = ["GPUWorker", "HostShard", "OptimizerWorker"]


def __getattr__(name: str) -> Any:
    if name not in _MODULES:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULES[name]), name)
