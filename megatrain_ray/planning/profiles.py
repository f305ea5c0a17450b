"""The measured rates of the machines the speed model knows (machines.yaml beside this file, each rate
with its source), the presets `megatrain plan --machine` names, and the AdamW rate a config gets on a host.
docs/speed-model.md explains where each rate comes from."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.exceptions import ConfigError

GiB = 2**30


@dataclass(frozen=True)
class GpuProfile:
    kind: str
    """h100 or h200."""
    name: str
    """As nvidia-smi names it."""
    memory: int
    """Bytes, as nvidia-smi reports memory.total."""
    model_tflops: float
    """Achieved model TFLOPS on GPU-busy time (recompute included in the time, not in the FLOPs), layers
    run eagerly."""
    compiled_model_tflops: float
    """The same with the layer template compiled (engine.compile)."""
    moe_model_tflops: float
    """The same for a mixture-of-experts model run eagerly (its active parameters' FLOPs): grouped expert products
    of small width and the routing's element-wise work run below the dense layers' rate."""
    moe_compiled_model_tflops: float
    """The same with the MoE layer template compiled (engine.compile, where the expert products take
    torch._grouped_mm)."""
    source: str
    lora_rate_fraction: float = 1.0
    """A LoRA run's layers reach this fraction of the rate (machines.yaml says how it was measured)."""

    def tflops(self, compiled: bool, moe: bool = False, lora: bool = False) -> float:
        """The achieved model TFLOPS of layers run compiled or eagerly, or of a MoE model's; of a LoRA run's."""
        if moe:
            rate = self.moe_compiled_model_tflops if compiled else self.moe_model_tflops
        else:
            rate = self.compiled_model_tflops if compiled else self.model_tflops
        return rate * (self.lora_rate_fraction if lora else 1.0)


REFERENCE_OPTIMIZER_BYTES = 28
"""DRAM bytes per parameter of the update the AdamW rates were measured with: fp32 master and moments
read and written (24), the bf16 gradient read (2), the bf16 streaming copy written (2)."""


def optimizer_dram_bytes(cfg: Config) -> float:
    """DRAM bytes per parameter of one update (FlatAdamW.bytes_per_element of the config's formats; with
    optimizer.state=lean FlatLeanAdamW's: 14 with int8 moments and bf16 gradients, plus the scales)."""
    run = RunSpec.resolve(cfg)
    if run.optimizer_state == "lean":
        moments = DTYPE_BYTES[run.moment_dtype]
        scales = 2 * 4 / run.lean_block if run.lean_block else 0.0
        return 2 * (2 * DTYPE_BYTES[run.master_dtype] + 2 * moments + scales) + DTYPE_BYTES[run.grad_dtype]
    master = DTYPE_BYTES[run.master_dtype]
    moments = DTYPE_BYTES[cfg.optimizer.moment_dtype]
    copy = 0 if run.stream_is_master else DTYPE_BYTES[run.stream_dtype]
    return 2 * master + 4 * moments + DTYPE_BYTES[run.grad_dtype] + copy


def speculative_extra_bytes(cfg: Config) -> int:
    """DRAM bytes per parameter a speculative update moves besides (optimizer.speculative_stages): the gradients it
    saves for a redo; with torch's kernel also the other set's master and moments, whose lines its stores read
    before writing them. The native kernel streams them out on x86, which the plan assumes of the machine
    (FlatAdamW.bytes_per_element with `speculative`)."""
    run = RunSpec.resolve(cfg)
    native = cfg.optimizer.runs_native_kernel(run.master_dtype, run.grad_dtype,
                                              None if run.stream_is_master else run.stream_dtype)
    state = DTYPE_BYTES[run.master_dtype] + 2 * DTYPE_BYTES[cfg.optimizer.moment_dtype]
    return DTYPE_BYTES[run.grad_dtype] + (0 if native else state)


def adamw_gparams(cfg: Config, host: "HostProfile") -> float:
    """The profile's AdamW rate for this config: DRAM-bound, so scaled by the bytes per parameter against
    the measured configuration's; with the moments on disk, at most what the disk moves (each moment read
    and written once per step). The lean state (optimizer.state=lean): its measured fraction of the full rate."""
    if cfg.optimizer.state == "lean":  # compute-bound where it was measured: its own fraction, not DRAM bytes
        return host.adamw_gparams * LEAN_RATE_FRACTION[cfg.optimizer.lean_moments]
    rate = host.adamw_gparams * REFERENCE_OPTIMIZER_BYTES / optimizer_dram_bytes(cfg)
    if cfg.host.moments_tier == "disk":
        rate = min(rate, host.disk_gbps / (4 * DTYPE_BYTES[cfg.optimizer.moment_dtype]))
    return rate


@dataclass(frozen=True)
class HostProfile:
    name: str
    h2d_gbps: float
    """Pinned host -> device copy, nothing else using DRAM."""
    h2d_loaded_gbps: float
    """The same while the CPU optimizer runs."""
    d2h_gbps: float
    adamw_gparams: float
    """CPU AdamW, all workers together, fp32 master and moments, while the engine runs."""
    control_seconds: float
    """Round trip of an update order to the optimizer workers and back."""
    source: str
    disk_gbps: float
    """Disk tier (host.moments_tier=disk): read plus write GB/s of host.disk_dir. Not measured on the GPU
    boxes: an assumption for an NVMe drive."""


@dataclass(frozen=True)
class SpeedProfile:
    """The measured rates that the speed model uses for one machine."""

    gpu: GpuProfile
    host: HostProfile
    assumptions: tuple[str, ...] = ()

    def with_optimizer_rate(self, gparams: float) -> "SpeedProfile":
        note = f"AdamW at {gparams:g} G params/s (--optimizer-gparams), not the measured {self.host.adamw_gparams:g}"
        return replace(self, host=replace(self.host, adamw_gparams=gparams), assumptions=(*self.assumptions, note))

    def with_disk_rate(self, gbps: float) -> "SpeedProfile":
        note = f"disk tier at {gbps:g} GB/s read + write (--disk-gbps), not the assumed {self.host.disk_gbps:g}"
        return replace(self, host=replace(self.host, disk_gbps=gbps), assumptions=(*self.assumptions, note))


MACHINES = yaml.safe_load((Path(__file__).with_name("machines.yaml")).read_text())
"""The measured rates (machines.yaml), read once."""
GPUS = {kind: GpuProfile(kind, g["name"], g["memory_mib"] * 2**20, g["model_tflops"], g["compiled_model_tflops"],
                         g["moe_model_tflops"], g["moe_compiled_model_tflops"], " ".join(g["source"].split()),
                         MACHINES["lora_rate_fraction"])
        for kind, g in MACHINES["gpus"].items()}
HOSTS = {kind: HostProfile(h["name"], h2d_gbps=h["h2d_gbps"], h2d_loaded_gbps=h["h2d_loaded_gbps"],
                           d2h_gbps=h["d2h_gbps"], adamw_gparams=h["adamw_gparams"],
                           control_seconds=MACHINES["control_seconds"], source=" ".join(h["source"].split()),
                           disk_gbps=MACHINES["disk_gbps"]) for kind, h in MACHINES["hosts"].items()}
H100, H200, H100_BOX, H200_BOX = GPUS["h100"], GPUS["h200"], HOSTS["h100"], HOSTS["h200"]
LEAN_RATE_FRACTION = MACHINES["lean_rate_fraction"]
"""The lean state's update rate as a fraction of the full state's, by optimizer.lean_moments (machines.yaml)."""
HOST_RAM = {"128gb": 128 * GiB, "512gb": 512 * GiB, "1tb": 1024 * GiB, "1.5tb": 1536 * GiB}
"""Installed RAM of the presets (DIMM sizes are binary: 16 x 32 GB = 512 GiB); 128gb: the single-GPU boxes the
measurements came from (nvidia-h100-x1, nvidia-h200)."""
MEMTOTAL_FRACTION = MACHINES["memtotal_fraction"]
"""Share of the installed RAM the kernel reports as MemTotal (125 of 128 GiB on the H100 box)."""


@dataclass(frozen=True)
class MachinePreset:
    name: str
    gpu: GpuProfile
    installed_ram: int

    @property
    def host_memory(self) -> int:
        return int(self.installed_ram * MEMTOTAL_FRACTION)

    @property
    def profile(self) -> SpeedProfile:
        return SpeedProfile(self.gpu, HOSTS[self.gpu.kind], (
            f"host assumed as fast as the measured {HOSTS[self.gpu.kind].name} (DRAM bandwidth bounds AdamW)",))


PRESETS = {f"{g}-{r}": MachinePreset(f"{g}-{r}", gpu, ram) for g, gpu in GPUS.items() for r, ram in HOST_RAM.items()}
"""`--machine` names: h100-128gb, h100-512gb, h100-1tb, h100-1.5tb, and the same for h200."""


def preset(name: str) -> MachinePreset:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"--machine {name!r} is not a known machine; choose one of {', '.join(PRESETS)}") from None


def profile_for_gpu(name: str) -> SpeedProfile | None:
    """The measured profile of a GPU as nvidia-smi names it (this machine), or None when none was measured
    (a GH200 is not an H200 here: its host link is another one)."""
    for kind, gpu in GPUS.items():
        if re.search(rf"\b{kind}\b", name.lower()):
            return SpeedProfile(gpu, HOSTS[kind], (f"host taken as the measured {HOSTS[kind].name}",))
    return None
