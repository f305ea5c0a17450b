"""GPUWorker: maps the host segments, registers them as pinned memory, runs the layer stream.

One per GPU: in a data-parallel run every worker of a node maps the same segments and joins the
run's process group (rendezvous, join) before the first step."""

from __future__ import annotations

import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from actors.base import ActorBase
from megatrain_ray.config.hf_vision import vision_config_of_dir
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.engine.adapters import ADAPTER_STAGE
from megatrain_ray.engine.collective import Collectives, RankInfo
from megatrain_ray.engine.lora_engine import LoraStreamEngine
from megatrain_ray.engine.rollout.interface import RolloutResult, SamplingSettings
from megatrain_ray.engine.vision_engine import attach_vision, engine_classes
from megatrain_ray.messages import Batch, StepResult
from megatrain_ray.model.hf_io import HFDirectory
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.observe.log import get_logger, init_logger
from megatrain_ray.store.checkpoint import CheckpointInfo, load_stage, write_stage
from megatrain_ray.store.initial_values import init_master, load_hf_master
from megatrain_ray.store.segments import STATE_KINDS, HostStore, SegmentSpec
from megatrain_ray.system.topology import bind_process, cpu_compute_threads, format_cpus

log = get_logger(__name__)


def resolve_device(device_type: str) -> torch.device:
    """The device the driver chose for this worker (RunSpec.device_type): this process's GPU, or the CPU."""
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("the run computes on a GPU but CUDA is not available to this worker; "
                               "set engine.device=auto or cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class GPUWorker(ActorBase):
    STORE_KINDS = ("stream", "grad", "gradpool", "sync", "nf4", "parity", "reference")
    """The host segments it maps (besides `master` where the master weights are streamed)."""
    PINNED_KINDS = ("master", "stream", "grad", "gradpool", "nf4", "reference")
    """Those it copies to and from the device, registered as pinned memory."""

    def __init__(self, cfg: Config, run: RunSpec, layout: ModelLayout, specs: list[SegmentSpec], optimizers: list[Any],
                 rank: RankInfo | None = None, cores: list[int] | None = None, restore: CheckpointInfo | None = None):
        """`optimizers`: the node's optimizer workers, for the rank that orders the updates (the first of
        its node); `rank`: the place in a data-parallel run, None for the only worker; `cores`: the cores
        the placement reserved for it (none in-process); `restore`: the checkpoint the run resumes from, which
        fills the GPU-resident stages (the shards fill the rest)."""
        self.rank = rank = rank or RankInfo()
        init_logger("gpu" if rank.world == 1 else f"gpu{rank.rank}")
        self.device = resolve_device(run.device_type)
        if self.device.type == "cuda":
            # Pinned before CUDA and NCCL start their threads, which inherit the cores: the launch, copy
            # and NCCL threads stay off the optimizer workers' cores (topology.RESERVED_CORES). On the CPU
            # this worker does the math itself and keeps every core it may use.
            binding = f"pinned to cpus {format_cpus(cores)}" if cores else "not pinned (in-process)"
            if cores:
                bind_process(cores)
            torch.set_num_threads(max(1, min(len(os.sched_getaffinity(0)), 4)))
        else:  # the node's ranks share the cores
            binding = "not pinned (computes on the CPU)"
            torch.set_num_threads(cpu_compute_threads(rank.local_world))
        # The parities: the update dispatch switches a speculatively updated stage's current set.
        self.store = HostStore([s for s in specs if s.kind in self.STORE_KINDS
                                or (s.kind == "master" and run.stream_is_master)])
        if self.device.type == "cuda":
            t0 = time.perf_counter()
            gib = self.store.register_pinned(self.PINNED_KINDS)
            log.info("registered %.2f GiB of host segments as pinned memory in %.1f s", gib, time.perf_counter() - t0)
        vision = vision_config_of_dir(cfg.model.path) is not None  # a vision-language model: engine/vision_engine.py
        full_engine, lora_engine = engine_classes(vision)
        if run.frozen_base and cfg.finetune.method == "lora":  # adapters on the device, a frozen streamed base
            self.engine = lora_engine(cfg.model, cfg.engine, cfg.parallel, cfg.optimizer, run, layout,
                                           self.store, self.device, cfg.finetune.lora, cfg.train.seed, rank)
            if restore is not None:
                self.engine.adapters.load(restore.directory, restore.entry_of(ADAPTER_STAGE))
        else:
            self.engine = full_engine(cfg.model, cfg.engine, cfg.parallel, cfg.optimizer, run, layout,
                                       self.store, optimizers, self.device, rank)
        if vision:
            attach_vision(self.engine, cfg, run, restore)
        self.layout = layout
        self._fill_resident(cfg, restore)
        self.comm: Collectives | None = None
        log.info("layer stream on %s (%s): compute %s, streaming %s; layer inputs %s (engine.activation_offload=%s); "
                 "layers %s (engine.compile=%s)%s%s",
                 self.device, binding, run.compute_dtype, run.stream_dtype,
                 "offloaded to pinned host memory" if run.activation_offload else "kept on the device",
                 cfg.engine.activation_offload,
                 "compiled by torch.compile on the first step" if run.layers_compiled else "eager",
                 cfg.engine.compile,
                 f"; rank {rank.rank} of {rank.world} (node {rank.node}, local rank {rank.local_rank})"
                 if rank.world > 1 else "",
                 f"; {run.resident_layers} layers resident on the device ({self._resident_bytes / 2**30:.2f} GiB"
                 f"{', the frozen base' if run.frozen_base else ''})" if run.resident_layers else "")

    @property
    def _resident_bytes(self) -> int:
        engine = self.engine
        return engine.resident_base_bytes if isinstance(engine, LoraStreamEngine) else engine.resident.bytes

    def rendezvous(self) -> str:
        """(Rank 0, ranks on several hosts) Where the others meet it: tcp://<this node's address>:<a free port>.
        torch's TCPStore listens on every interface: a multi-host cluster runs on its private network."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, init_method: str, backend: str, timeout_s: float, loopback: bool) -> None:
        """Join the run's process group (every rank at once; returns when all have joined). `loopback`:
        every rank is on this host, so gloo's and NCCL's bootstrap sockets stay on 127.0.0.1."""
        if loopback:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        t0 = time.perf_counter()
        self.comm = Collectives(self.rank, backend, init_method, timeout_s, self.device)
        self.engine.comm = self.comm
        log.info("rank %d of %d joined the %s process group in %.1f s", self.rank.rank, self.rank.world, backend,
                 time.perf_counter() - t0)

    def train_step(self, batch: Batch, lr: float, adam_step: int, loss_tokens: int) -> StepResult:
        return self.engine.train_step(batch, lr, adam_step, loss_tokens)

    def arm_nan_grad(self) -> None:
        """Fault drill `nan_grad`: the next training step puts a NaN into the first layer's gradients."""
        self.engine.arm_nan_grad()

    def eval_loss(self, batch: Batch) -> tuple[float, int]:
        return self.engine.eval_loss(batch)

    def logits(self, ids: torch.Tensor, images: Any = None) -> torch.Tensor:
        if images is None:
            return self.engine.logits(ids)
        if getattr(self.engine, "vision", None) is None:
            raise ValueError("the batch has images but the model has no vision tower (model.path is a text model)")
        return self.engine.logits(ids, images)

    def sequence_logps(self, batch: Batch) -> torch.Tensor:
        return self.engine.sequence_logps(batch)

    def token_logps(self, batch: Batch, temperature: float = 1.0, reference: bool = False) -> torch.Tensor:
        """GRPO: each label's log-probability at `temperature` under the current weights, or with `reference` under
        the reference model's (the initial weights; LoRA: the base alone), [rows, seq_len] (engine/forward_only.py)."""
        return self.engine.token_logps(batch, temperature, reference)

    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutResult:
        """Completions of the prompts under the current weights (the rollout engine, engine/rollout/)."""
        return self.engine.generate(prompts, sampling)

    def flush(self) -> float:
        return self.engine.flush()

    # ------------------------------------------------------------------ the GPU-resident stages' state

    def _fill_resident(self, cfg: Config, restore: CheckpointInfo | None) -> None:
        """The resident stages' initial state, as the shards fill theirs: from the checkpoint resumed, the
        Hugging Face directory fine-tuned, or the seeded random initialisation (the same values wherever a
        stage lives); one stage at a time through CPU buffers."""
        tier = self.engine.resident
        source = HFDirectory(cfg.model.path) if tier.stages and restore is None and cfg.model.path else None

        def fill(stage: StageLayout) -> None:
            flats = tier.staging(stage, STATE_KINDS if restore is not None else ("master",))
            if restore is not None:
                load_stage(restore.directory, stage, flats, restore.entry_of(stage.index))
            elif source is not None:
                load_hf_master(flats["master"], stage, source)
            else:
                init_master(flats["master"], stage, cfg.train.seed, cfg.model.initializer_range)
            tier.put(stage, flats)
        # A few stages at once, as the shards fill theirs (the seeded draws and file reads let go of the GIL);
        # a few only: each holds a stage-sized CPU buffer per kind.
        with ThreadPoolExecutor(max(1, min(4, len(tier.stages), os.cpu_count() or 1))) as pool:
            for done in [pool.submit(fill, stage) for stage in tier.layouts]:
                done.result()

    def save_resident(self, step: int, directory: str) -> list[dict]:
        """Write the resident stages' files of a checkpoint (after every ordered update); their manifest entries."""
        self.engine.flush()
        tier = self.engine.resident
        entries = [write_stage(Path(directory), stage, tier.take(stage), step) for stage in tier.layouts]
        if isinstance(self.engine, LoraStreamEngine):  # the adapters and their AdamW state
            entries.append(self.engine.adapters.save(Path(directory), step))
        if getattr(self.engine, "vision", None) is not None:  # the vision tower and projector's trained state
            entries.append(self.engine.vision.save(Path(directory), step))
        return entries

    def vision_state(self) -> dict[str, torch.Tensor]:
        """(A vision-language model) The tower's and projector's tensors by module name, on the CPU."""
        self.engine.flush()
        return self.engine.vision.state()

    def reload_base(self) -> None:
        """(LoRA) The host's base was overwritten: the device's copies of it are read again."""
        self.engine.reload_base()

    def adapters(self) -> dict[str, torch.Tensor]:
        """(LoRA) The adapters by PEFT name, on the CPU, after every step taken."""
        return self.engine.adapters.named()

    def set_adapters(self, tensors: dict[str, torch.Tensor]) -> None:
        """(LoRA) Overwrite adapters by PEFT name (tests: the same start as a reference)."""
        self.engine.adapters.put_named(tensors)

    def resident_tensors(self, kind: str, stage: int | None = None) -> dict[str, torch.Tensor]:
        """The resident stages' `kind` (master, exp_avg or exp_avg_sq) by Hugging Face name, copied to the CPU;
        `stage`: that stage's only (export fetches one stage at a time)."""
        self.engine.flush()
        tier, out = self.engine.resident, {}
        for stage in [s for s in tier.layouts if stage is None or s.index == stage]:
            flat = tier.take(stage, (kind,))[kind]
            out.update({stage.hf_name(s): flat[s.offset:s.offset + s.numel].view(s.shape) for s in stage.slots})
        return out

    def write_resident(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the resident stages' master weights named in `tensors` (the others are the shards')."""
        self.engine.flush()
        tier = self.engine.resident
        for name, value in tensors.items():
            stage, slot = self.layout.stage_of(name)
            if tier.holds(stage):
                if tuple(value.shape) != slot.shape:
                    raise ValueError(f"tensor {name}: shape {tuple(value.shape)} != model's {slot.shape}")
                tier.write_tensor(stage, slot.offset, value)

    def device_name(self) -> str:
        return torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"

    def shutdown(self) -> None:
        try:
            self.engine.close()
        finally:
            if self.comm is not None:
                self.comm.close()
                self.comm = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.store.unregister_pinned()
            torch.cuda.empty_cache()  # the engine let go of its buffers: give the memory back to the device
