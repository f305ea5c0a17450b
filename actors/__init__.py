"""The three actor kinds: HostShard (owns host segments), OptimizerWorker (CPU AdamW), GPUWorker
(the layer stream). Plain classes: `megatrain_ray.driver.runtime.spawn` runs them as Ray actors or in-process."""

from actors.gpu_worker import GPUWorker
from actors.host_shard import HostShard
from actors.optimizer_worker import OptimizerWorker

__all__ = ["GPUWorker", "HostShard", "OptimizerWorker"]
