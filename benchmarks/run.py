"""Benchmark harness: megatrain-ray, a GPU-resident PyTorch baseline and DeepSpeed ZeRO-3 offload,
on the same model, batch and sequence, in one invocation.

    python benchmarks/run.py --config configs/shapes/llama-3.5b-bench.yaml --batches 4,16,32 \\
        --systems megatrain,resident,deepspeed [--layers 8,16,24] [--steps 5 --warmup 2] [--set KEY=VALUE]
    python benchmarks/run.py --systems megatrain --gpus 1,2 --batches 4,16     # data-parallel scaling

Each (system, depth, batch) point runs in a process of its own, so one system's memory never
weighs on the next; a point that fails records its error (OOM included) instead of a figure.
The results go to one JSON file in benchmarks/results/ that names the device and the commit.

Systems:
- megatrain: the product through its Ray path (Trainer, actors, shared-memory host store), with the
  config's clipping and engine.compile (auto: the decoder layer through torch.compile on the GPU);
  megatrain-noclip: the same with optimizer.grad_clip=0; the -eager and -compile variants with
  engine.compile=false and true (benchmarks/common.py VARIANTS). Rows record `compiled`.
  megatrain-streamed: every stage streamed (engine.gpu_resident=none); megatrain-streamed-lean: the same
  with optimizer.state=lean (its vs_streamed is lean over full). Rows record `optimizer_state`.
- resident: the whole model on the GPU (Hugging Face LlamaForCausalLM in bf16, SDPA attention,
  activation checkpointing per layer, torch fused AdamW on the GPU, clip_grad_norm_), layers eager.
- resident-compile: the same with each decoder layer through torch.compile, and activation
  checkpointing only when the model with every activation kept does not fit (the row's
  `checkpointing` says which): the GPU-resident run a user would pick. Every `vs_resident` ratio is
  over the faster of the two resident rows of the same point.
- deepspeed: the same Hugging Face model under DeepSpeed ZeRO-3 with parameters and optimizer
  offloaded to pinned CPU memory (DeepSpeedCPUAdam), bf16, activation checkpointing.
- LoRA (benchmarks/lora.py; the config's finetune.lora settings, e.g. --set finetune.lora.r=16): megatrain-lora
  (finetune.method=lora) against peft-resident, peft-resident-compile and peft-deepspeed; a LoRA row's
  vs_resident and vs_deepspeed are over the LoRA baselines, and its roofline is max(GPU compute, H2D bytes / the
  pinned H2D bandwidth probed after the run): the base streamed in is the step's only host traffic.

Data parallel (--gpus 1,2): megatrain runs with parallel.gpus=N at the same batch per GPU (--batches
counts sequences per GPU; the global batch is N times that), so the rows compare tok/s and host RAM
for 1 and N GPUs (`vs_one_gpu`: tok/s over the 1-GPU row of the same system, depth and per-GPU batch;
`host_gib`: shared segments + every process's private memory). The baselines run on one GPU only.

Model TFLOPS = tok/s x (6 N + 6 L T d_attn) / 1e12 for every system (megatrain_ray/observe/metrics.py):
N = parameters in matrix products (LM head included), L layers, T sequence length, d_attn =
heads x head_dim; recomputation is not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULT_TAG = "BENCH_RESULT "

from benchmarks.common import (  # noqa: E402
    LORA_RESIDENT_SYSTEMS,
    ONE_GPU_AS,
    RESIDENT_SYSTEMS,
    STREAMED_SYSTEM,
    VARIANTS,
    compiled_resident_run,
    deepspeed_train_step,
    host_memory,
    point_overrides,
    provenance,
    seq_len_overrides,
    write_result,
    zero3_offload_config,
)
from benchmarks.lora import LORA_SYSTEMS, h2d_probe_gbps  # noqa: E402
from megatrain_ray.observe.metrics import optimizer_hidden_fraction, proc_status_bytes  # noqa: E402
from megatrain_ray.planning.machine import query_gpu  # noqa: E402

# ----------------------------------------------------------------------------- one point (child process)


def _load(spec: dict):
    from megatrain_ray.config.load import load_config

    overrides = [*spec["overrides"], *point_overrides(spec["batch"], spec.get("gpus", 1), spec["layers"]),
                 f"train.steps={spec['warmup'] + spec['steps']}", "schedule.warmup_steps=0",
                 f"train.output_dir={spec['run_dir']}", "runtime.dashboard=false"]
    return load_config(spec["config"], overrides)


def _common(cfg, tokens_per_s: float) -> dict:
    from megatrain_ray.model.flops import model_flops_per_token
    from megatrain_ray.model.layout import build_layout

    layout = build_layout(cfg.model)
    flops = model_flops_per_token(cfg.model, layout, cfg.data.seq_len)
    return {"params": layout.num_params, "tok_per_s": tokens_per_s, "tflops": tokens_per_s * flops / 1e12}


def run_megatrain(spec: dict) -> dict:
    from megatrain_ray.driver.trainer import Trainer
    from megatrain_ray.planning.machine import Machine
    from megatrain_ray.planning.memory import plan_run

    cfg = _load(spec)
    plan = plan_run(cfg, Machine.detect(cfg.host.shm_dir))  # before the store takes the shared memory
    started = time.perf_counter()
    with Trainer(cfg) as trainer:
        startup_seconds = time.perf_counter() - started  # Ray, the host store filled (NF4: packed), the engine
        records = [trainer.step(s) for s in range(spec["warmup"] + spec["steps"])]
        trainer.flush()
        host = host_memory(trainer, trainer.layout.num_params)
        device = trainer.device_name
        lora = cfg.finetune.method == "lora"
        run = trainer.run_spec  # the settings the run resolved (compiled layers, gradient home, ...)
        workers = len(trainer.optimizers)
        # Which cores each optimizer worker ran its threads on (one thread per core; none: in-process).
        worker_cores = [trainer.placement.worker_cores(w) for w in range(workers)] if trainer.placement else []
    measured = records[spec["warmup"]:]
    wall = sum(r["step_seconds"] for r in measured)
    tokens = sum(r["tokens"] for r in measured)
    row = _common(cfg, tokens / wall)
    params = row["params"]
    mean = lambda key: sum(r[key] for r in measured) / len(measured)  # noqa: E731
    opt_wall = mean("optimizer_seconds")
    by_rank = [r["rank_update_wait_seconds"] for r in measured if r.get("rank_update_wait_seconds")]
    row.update({
        "device": device, "gpu_peak_gib": max(r["gpu_peak_gib"] for r in measured),
        **host, "host_gib": host["host_bytes_per_param"] * params / 2**30, "gpus": cfg.parallel.gpus,
        "comm_seconds": mean("comm_seconds"),
        "grad_home": run.grad_home, "grad_dtype": run.grad_dtype, "clip": cfg.optimizer.grad_clip,
        "vocab_grad_pieces": run.vocab_in_pieces, "compiled": run.layers_compiled,
        "stream_dtype": cfg.precision.resolved_stream_dtype, "optimizer_state": cfg.optimizer.state,
        "optimizer_workers": workers, "optimizer_worker_cores": worker_cores,
        "step_seconds": wall / len(measured), "gpu_busy": mean("gpu_busy"),
        # The GPU worker's own time of the step (the rest of step_seconds: the driver's call, Ray's hand-over of
        # the batch and of the result), and a vision-language model's tower and projector on the device.
        "worker_seconds": sum(r.get("worker_seconds", 0.0) for r in measured) / len(measured),
        **({"vision_seconds": mean("vision_seconds")} if all("vision_seconds" in r for r in measured) else {}),
        "compute_seconds": mean("compute_seconds"),
        "h2d_gbps_link": mean("h2d_link_gbps"), "d2h_gbps_link": mean("d2h_link_gbps"),
        "h2d_gbps_avg": mean("h2d_gbps"), "d2h_gbps_avg": mean("d2h_gbps"),
        "optimizer_seconds": opt_wall, "optimizer_wait_seconds": mean("update_wait_seconds"),
        "optimizer_slab_wait_seconds": mean("slab_wait_seconds"),
        **({"optimizer_wait_seconds_by_rank": [sum(w) / len(by_rank) for w in zip(*by_rank)]} if by_rank else {}),
        "optimizer_gparams_per_s": params / opt_wall / 1e9 if opt_wall else None,
        "dram_bytes_per_param": mean("dram_bytes_per_param"),
        "losses": [r["loss"] for r in records],
        "grad_norms": [r["grad_norm"] for r in records],  # before clipping: whether the clip acted
        "activation_offload": plan.offload,
        "plan": {"host_gib": plan.host_total / 2**30, "gpu_peak_gib": plan.gpu_peak / 2**30,
                 "tok_per_s": plan.expected.tok_per_s if plan.expected else None},
        "startup_seconds": startup_seconds,
        "finetune": cfg.finetune.method, "resident_layers": run.resident_layers,
        "resident_vocab": run.resident_vocab, "kept_layers": run.kept_layers,
        "h2d_gb_per_step": mean("h2d_gbps") * wall / len(measured),
    })
    import torch

    if lora and torch.cuda.is_available():  # after the run: this process's CUDA context never weighed on it
        row["h2d_probe_gbps"] = h2d_probe_gbps()
    return row


def _hf_model(cfg):
    import transformers

    from megatrain_ray.config.hf import hf_config_from_model

    hf = transformers.AutoConfig.for_model(**hf_config_from_model(cfg.model))
    hf._attn_implementation = "sdpa"
    return getattr(transformers, hf.architectures[0]), hf


def _timed_steps(spec: dict, cfg, train_step) -> dict:
    """Run `train_step(input_ids) -> loss tensor` for warmup + measured steps on the harness's batches;
    the row of a baseline (the same data, timing and figures for every system but megatrain). The spec's
    `device` is cuda (the default) or cpu (the harness's tests off the GPU machine)."""
    import torch

    from megatrain_ray.data.token_batches import TokenBatches

    cuda = spec.get("device", "cuda") == "cuda"
    data = TokenBatches(cfg.data, cfg.model.vocab_size)
    times, losses = [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(spec["warmup"] + spec["steps"]):
        ids = data.tokens_of(step)[:, :-1].to(spec.get("device", "cuda"))
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(train_step(ids).item())
        times.append(time.perf_counter() - t0)
    wall = sum(times[spec["warmup"]:])
    row = _common(cfg, spec["batch"] * cfg.data.seq_len * spec["steps"] / wall)
    row.update({"device": torch.cuda.get_device_name() if cuda else "cpu",
                "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "step_seconds": wall / spec["steps"], "losses": losses})
    return row


def _resident_model(cfg, compile_layers: bool, checkpointing: bool):
    """The Hugging Face model on the GPU in bf16 with torch fused AdamW; optionally each decoder layer
    through torch.compile and activation checkpointing per layer."""
    import torch

    cls, hf = _hf_model(cfg)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = cls(hf)
    torch.set_default_dtype(torch.float32)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    if compile_layers:
        for layer in model.model.layers:
            layer.compile()
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, fused=True)

    def train_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, opt, train_step


def run_resident(spec: dict) -> dict:
    cfg = _load(spec)
    _, _, train_step = _resident_model(cfg, compile_layers=False, checkpointing=True)
    row = _timed_steps(spec, cfg, train_step)
    row.update(precision="bf16 weights, bf16 AdamW states (torch fused AdamW on the GPU)", compiled=False,
               checkpointing=True)
    return row


def run_resident_compile(spec: dict) -> dict:
    """The strongest GPU-resident baseline: each decoder layer through torch.compile; activation
    checkpointing only when the model with every activation kept does not fit (tried first)."""
    cfg = _load(spec)

    def build(checkpointing: bool):
        model, _, train_step = _resident_model(cfg, compile_layers=True, checkpointing=checkpointing)
        return model, train_step

    row, checkpointing, _ = compiled_resident_run(build, lambda step: _timed_steps(spec, cfg, step))
    row.update(precision="bf16 weights, bf16 AdamW states (torch fused AdamW on the GPU)", compiled=True,
               checkpointing=checkpointing)
    return row


def run_deepspeed(spec: dict) -> dict:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    cfg = _load(spec)
    o = cfg.optimizer
    ds_config = zero3_offload_config(o, spec["batch"])
    _refuse_what_deepspeed_says_will_not_fit(cfg)
    deepspeed.init_distributed(dist_backend="nccl")
    cls, hf = _hf_model(cfg)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = cls(hf)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)

    row = _timed_steps(spec, cfg, deepspeed_train_step(engine))
    row["host_bytes_per_param"] = proc_status_bytes("VmRSS") / row["params"]  # DeepSpeed's host state is in-process
    return row


def _refuse_what_deepspeed_says_will_not_fit(cfg) -> None:
    """Fail the point at once when DeepSpeed's own lower bound for ZeRO-3 with parameter and optimizer offload
    (its estimator at buffer factor 1.0: 18 bytes per parameter of host memory) exceeds the RAM this process may
    use. Without it the point runs into the kernel's OOM killer minutes later (24.4 B/param measured at 3.5B)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    from megatrain_ray.model.layout import build_layout
    from megatrain_ray.planning.machine import Machine

    layout = build_layout(cfg.model)
    largest = max(layout.max_layer_numel, layout.embed.numel, layout.head.numel)
    host_needed, *_ = estimate_zero3_model_states_mem_needs(layout.num_params, largest, cpu_offload=True,
                                                             cpu_offload_params=True, zero_init=True,
                                                             additional_buffer_factor=1.0)
    limit = Machine.detect(cfg.host.shm_dir).host_memory
    if host_needed > limit:
        raise MemoryError(
            f"host out of memory before the first step: DeepSpeed's own estimate for {layout.num_params / 1e9:.2f} B "
            f"parameters (estimate_zero3_model_states_mem_needs, buffer factor 1.0) is {host_needed / 2**30:.1f} "
            f"GiB of host memory; this process may use {limit / 2**30:.1f} GiB. Not run.")


SYSTEMS = {"megatrain": run_megatrain, "resident": run_resident, "resident-compile": run_resident_compile,
           "deepspeed": run_deepspeed, **LORA_SYSTEMS}


def child(system: str, spec: dict) -> None:
    try:
        base, extra = VARIANTS.get(system, (system, []))
        row = SYSTEMS[base]({**spec, "overrides": [*spec["overrides"], *extra]})
        row["status"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a failed point is a result too
        text = f"{type(exc).__name__}: {exc}"
        row = {"status": "oom" if "out of memory" in text.lower() else "error", "error": text[-2000:],
               "traceback": traceback.format_exc()[-4000:]}
    print(RESULT_TAG + json.dumps(row), flush=True)


# ----------------------------------------------------------------------------- the invocation (parent)


TIMEOUT_LOG_LINES = 40
"""Lines of a timed-out point's log kept in its row: where its time went (start-up, a step) is then on record."""


def run_child(command: list[str], timeout: float) -> dict:
    """One point's process: its result row, or an error row (its exit and log; the kernel's OOM evidence when
    it was killed for host memory; on a timeout, the last TIMEOUT_LOG_LINES lines it logged)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        lines = (stdout + stderr).splitlines()
        return {"status": "error", "error": f"timed out after {timeout} s", "log_tail": lines[-TIMEOUT_LOG_LINES:]}
    found = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if found:
        return json.loads(found[-1][len(RESULT_TAG):])
    if proc.returncode == -9 and (evidence := kernel_oom_lines(proc.pid)):
        return {"status": "oom", "error": "killed by the kernel's OOM killer (host memory): " + evidence[-1],
                "kernel_log": evidence}
    return {"status": "error", "error": f"exit {proc.returncode}: {stderr[-2000:]}"}


SHM_WAIT_S = 90
"""How long a point waits for the previous one's shared memory to come back (benchmarks/run.py wait_for_shm)."""


def shm_free_bytes(shm_dir: str) -> int:
    stat = os.statvfs(shm_dir)
    return stat.f_bavail * stat.f_frsize


def wait_for_shm(shm_dir: str, free_at_start: int, slack: int = 2**30) -> None:
    """Wait (at most SHM_WAIT_S) until `shm_dir` has as much free space as when the harness started, less
    `slack`: a point's segments are unlinked when it ends, but their space comes back only once the last of its
    actor processes has exited, and a point started before that would be planned (and refused) on the rest."""
    deadline = time.monotonic() + SHM_WAIT_S
    while shm_free_bytes(shm_dir) < free_at_start - slack and time.monotonic() < deadline:
        time.sleep(1.0)


def kernel_oom_lines(pid: int) -> list[str]:
    """The kernel log's lines about OOM-killing process `pid` (a child that exited on SIGKILL without a
    result), or [] when there are none or the log cannot be read (dmesg needs privileges on many hosts)."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in log.splitlines()
            if f"process {pid} " in ln or f"pid={pid}," in ln]  # "(Killed|reaped) process N (", "pid=N,"


def dram_bandwidth_gbs(gib: float = 2.0, repeats: int = 5) -> float:
    """Host memory bandwidth, read + write bytes of a large multi-threaded copy (the best of a few)."""
    import torch

    n = int(gib * 2**30 / 4)
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * n * 4 / best / 1e9


def adamw_bandwidth_gbs(params: int = 1 << 28, repeats: int = 3) -> float:
    """Host DRAM bandwidth under the optimizer's own access pattern: the native AdamW kernel on every
    core over `params` fp32 weights with bf16 gradients and copy (28 bytes per parameter)."""
    import torch

    from megatrain_ray.config.engine_sections import OptimizerConfig
    from megatrain_ray.optim.adamw import FlatAdamW

    adamw = FlatAdamW(OptimizerConfig(), torch.float32, threads=os.cpu_count() or 1)
    p, m, v = torch.ones(params), torch.zeros(params), torch.zeros(params)
    g = torch.ones(params, dtype=torch.bfloat16)
    best = float("inf")
    for step in range(1, repeats + 2):
        t0 = time.perf_counter()
        adamw.update(master=p, exp_avg=m, exp_avg_sq=v, grad=g, stream_out=g, start=0, end=params,
                     decay_end=params, adam_step=step, lr=1e-4, grad_coef=1.0)
        if step > 1:  # the first pass also faults the pages in
            best = min(best, time.perf_counter() - t0)
    return adamw.bytes_per_element(g, g) * params / best / 1e9


def derive(rows: list[dict], bandwidth_gbs: float | None, adamw_measured: bool = True) -> None:
    """Figures computed from the measured ones (also rerun on stored files by --rederive):
    - optimizer_hidden_fraction: megatrain_ray.observe.metrics.optimizer_hidden_fraction (GPU idle time bounds
      the exposed optimizer time).
    - roofline_seconds = max(compute, DRAM bytes / DRAM bandwidth); roofline_fraction = that / step time. A LoRA
      row (no host optimizer, the frozen base its only host traffic): max(compute, H2D bytes / probed H2D
      bandwidth), roofline_bound "gpu" or "h2d".
    - vs_resident: tok/s over the fastest GPU-resident row (resident or resident-compile, named in
      vs_resident_system; peft-resident or peft-resident-compile for LoRA rows) at the same depth, batch and
      sequence length (1 GPU); vs_deepspeed: over the deepspeed row (peft-deepspeed for LoRA rows).
    - vs_streamed: a megatrain row's tok/s over the megatrain-streamed row (engine.gpu_resident=none) of the
      same point: what the default config gains over streaming every stage.
    - vs_one_gpu: tok/s of an N-GPU row over the same system's 1-GPU row at the same depth and per-GPU batch
      (common.ONE_GPU_AS: a variant that differs only with several GPUs over the row of the one it equals).
    """
    for row in rows:
        if row["status"] != "ok":
            continue
        lora = row.get("finetune") == "lora"
        if row["system"].startswith("megatrain"):
            row["optimizer_hidden_fraction"] = optimizer_hidden_fraction(
                row["optimizer_seconds"], row["step_seconds"], row["compute_seconds"])
        if row["system"].startswith("megatrain") and lora and row.get("h2d_probe_gbps"):
            h2d_seconds = row["h2d_gb_per_step"] / row["h2d_probe_gbps"]
            row["roofline_seconds"] = max(row["compute_seconds"], h2d_seconds)
            row["roofline_bound"] = "gpu" if row["compute_seconds"] >= h2d_seconds else "h2d"
            row["roofline_fraction"] = row["roofline_seconds"] / row["step_seconds"]
        elif row["system"].startswith("megatrain") and not lora and bandwidth_gbs:
            # With N GPUs the DRAM bytes are every rank's copies plus one optimizer pass: all share the host.
            dram_seconds = row["dram_bytes_per_param"] * row["params"] / (bandwidth_gbs * 1e9)
            row["roofline_seconds"] = max(row["compute_seconds"], dram_seconds)
            row["roofline_bound"] = "compute" if row["compute_seconds"] >= dram_seconds else "dram"
            row["roofline_fraction"] = row["roofline_seconds"] / row["step_seconds"]
            if row["roofline_bound"] == "dram" and not adamw_measured:
                # A plain copy understates what the optimizer and the copy engines reach together: a
                # DRAM-bound roofline from it means nothing (a compute-bound one stays exact).
                row["roofline_seconds"] = row["roofline_fraction"] = None

        def same_point(r: dict) -> bool:
            return (r["layers"] == row["layers"] and r["batch"] == row["batch"] and r.get("seq_len") == row.get("seq_len")
                    and r["status"] == "ok")
        # Against the strongest GPU-resident row of the same point (compiled layers where it ran).
        residents = LORA_RESIDENT_SYSTEMS if lora else RESIDENT_SYSTEMS
        same = [r for r in rows if same_point(r) and r["system"] in residents]
        if same and row.get("gpus", 1) == 1:
            best = max(same, key=lambda r: r["tok_per_s"])
            row["vs_resident"] = row["tok_per_s"] / best["tok_per_s"]
            row["vs_resident_system"] = best["system"]
        offload = [r for r in rows if same_point(r) and r["system"] == ("peft-deepspeed" if lora else "deepspeed")]
        if offload and row.get("gpus", 1) == 1 and row["system"] != offload[0]["system"]:
            row["vs_deepspeed"] = row["tok_per_s"] / offload[0]["tok_per_s"]
        streamed = [r for r in rows if same_point(r) and r["system"] == STREAMED_SYSTEM
                    and r.get("gpus", 1) == row.get("gpus", 1)]
        if streamed and row["system"].startswith("megatrain") and row["system"] != STREAMED_SYSTEM:
            row["vs_streamed"] = row["tok_per_s"] / streamed[0]["tok_per_s"]
        one_gpu = [r for r in rows if r["layers"] == row["layers"] and r["batch"] == row["batch"]
                   and r["system"] == ONE_GPU_AS.get(row["system"], row["system"]) and r.get("gpus", 1) == 1
                   and r["status"] == "ok"]
        if one_gpu and row.get("gpus", 1) > 1:
            row["vs_one_gpu"] = row["tok_per_s"] / one_gpu[0]["tok_per_s"]


def rederive(paths: list[str]) -> None:
    for name in paths:
        result = json.loads(Path(name).read_text())
        derive(result["rows"], result["host_dram_gbs"], "host_dram_gbs_adamw" in result)
        tmp = Path(name).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, name)
        for row in result["rows"]:
            print(summary_line(row))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "shapes" / "llama-3.5b-bench.yaml"))
    parser.add_argument("--systems", default="megatrain,resident-compile,resident,deepspeed")
    parser.add_argument("--batches", default="4,16,32", help="sequences per step (per GPU), comma-separated")
    parser.add_argument("--gpus", default="1", help="megatrain's parallel.gpus values, comma-separated (data "
                        "parallel at the same per-GPU batch; the other systems run on 1 GPU)")
    parser.add_argument("--no-roofline", action="store_true",
                        help="skip the host bandwidth measurement (and the roofline figures): quick CPU checks")
    parser.add_argument("--layers", default="", help="depths, comma-separated (default: the config's)")
    parser.add_argument("--seq-lens", default="", help="sequence lengths, comma-separated (default: the config's; "
                        "model.max_position_embeddings is raised to each when below it)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per point")
    parser.add_argument("--warmup", type=int, default=2, help="steps run before measuring")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--trace", default="", metavar="DIR", help="megatrain points write engine.update_trace files "
                        "to DIR/<system>-g<gpus>-b<batch>-l<layers>-s<seq> (benchmarks/update_trace.py reads them)")
    parser.add_argument("--name", default="bench", help="name of the results file")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per point")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--rederive", nargs="+", metavar="RESULT_JSON", help="recompute derived figures of files")
    parser.add_argument("--child", nargs=2, metavar=("SYSTEM", "SPEC_JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], json.loads(args.child[1]))
        return 0
    if args.rederive:
        rederive(args.rederive)
        return 0

    from megatrain_ray.config.load import load_config

    base = load_config(args.config, args.set)
    layers = [int(x) for x in args.layers.split(",")] if args.layers else [base.model.num_layers]
    seq_lens = [int(x) for x in args.seq_lens.split(",")] if args.seq_lens else [base.data.seq_len]
    batches = [int(x) for x in args.batches.split(",")]
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {sorted(SYSTEMS) + sorted(VARIANTS)}")
    gpu_counts = [int(x) for x in args.gpus.split(",")]
    if args.no_roofline:
        copy_bw = adamw_bw = bandwidth = None
    else:
        copy_bw, adamw_bw = dram_bandwidth_gbs(), adamw_bandwidth_gbs()
        bandwidth = max(copy_bw, adamw_bw)
        print(f"host DRAM bandwidth: copy {copy_bw:.1f} GB/s, AdamW pattern {adamw_bw:.1f} GB/s (roofline uses "
              f"{bandwidth:.1f})", flush=True)
    points = [(system, gpus) for system in systems for gpus in gpu_counts
              if (gpus == 1 and ONE_GPU_AS.get(system) not in systems) or (gpus > 1 and system.startswith("megatrain"))]
    rows: list[dict] = []
    path = None

    def result_of(rows: list[dict]) -> dict:
        # A file none of whose rows ran (OOM, errors) names the GPU through nvidia-smi: the parent never
        # initialises CUDA itself, as its context would take memory from the points.
        device = next((r["device"] for r in rows if r.get("device")), None) or query_gpu()[1] or "cpu"
        return {
            **provenance(device), "config": os.path.relpath(args.config, ROOT), "overrides": args.set,
            "steps": args.steps, "warmup": args.warmup, "host_dram_gbs": bandwidth,
            "host_dram_gbs_copy": copy_bw, "host_dram_gbs_adamw": adamw_bw,
            "tflops_formula": "tok/s * (6 N + 6 L T d_attn) / 1e12; N = parameters in matrix products",
            "rows": rows, "points_planned": len(points),
        }

    points = [(seq, depth, batch, system, gpus) for seq in seq_lens for depth in layers for batch in batches
              for system, gpus in points]
    shm_free = shm_free_bytes(base.host.shm_dir)
    for seq, depth, batch, system, gpus in points:
        wait_for_shm(base.host.shm_dir, shm_free)
        overrides = args.set if seq == base.data.seq_len else [*args.set, *seq_len_overrides(base, seq)]
        if args.trace and system.startswith("megatrain"):
            trace_dir = Path(args.trace) / f"{system}-g{gpus}-b{batch}-l{depth}-s{seq}"  # load_config resolves it
            overrides = [*overrides, f"engine.update_trace={trace_dir}"]
        with tempfile.TemporaryDirectory() as tmp:
            spec = {"config": args.config, "overrides": overrides, "batch": batch, "layers": depth,
                    "steps": args.steps, "warmup": args.warmup, "run_dir": str(Path(tmp) / "run"), "gpus": gpus}
            t0 = time.perf_counter()
            row = run_child([sys.executable, __file__, "--child", system, json.dumps(spec)], args.timeout)
        row.update(system=system, layers=depth, batch=batch, gpus=gpus, seq_len=seq,
                   tokens_per_step=batch * gpus * seq, wall_seconds=time.perf_counter() - t0)
        if row.get("gpu_peak_gib"):
            row["gpu_peak_bytes_per_token"] = row["gpu_peak_gib"] * 2**30 / (batch * seq)
        rows.append(row)
        derive(rows, bandwidth)
        print(summary_line(row), flush=True)
        # Saved after every point: a run cut short (a device call's time limit) keeps what it measured.
        path = write_result(args.name, result_of(rows), args.out, path, quiet=len(rows) < len(points))
    return 0


def _fraction(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def summary_line(row: dict) -> str:
    head = (f"{row['system']:>9} L{row['layers']:<3} B{row['batch']:<3} G{row.get('gpus', 1)} "
            f"{row['tokens_per_step']:>7} tok/step: ")
    if row["status"] != "ok":
        return head + f"{row['status'].upper()} {row.get('error', '')[:300]}"
    text = head + f"{row['tok_per_s']:>9,.0f} tok/s {row['tflops']:6.1f} TFLOPS peak {row['gpu_peak_gib']:.1f} GiB"
    if row["system"].startswith("megatrain"):
        text += (f" | busy {row['gpu_busy']:.2f} H2D {row['h2d_gbps_link']:.0f} GB/s "
                 f"opt {row['optimizer_seconds']:.2f}s waited {row['optimizer_wait_seconds']:.2f}s "
                 f"(slabs {row.get('optimizer_slab_wait_seconds') or 0:.2f}s"
                 + (f", by rank {' '.join(f'{w:.2f}' for w in row['optimizer_wait_seconds_by_rank'])}"
                    if row.get("optimizer_wait_seconds_by_rank") else "") + ") "
                 f"hidden {row['optimizer_hidden_fraction']:.2f} host {row['host_bytes_per_param']:.1f} B/param "
                 f"dram {row['dram_bytes_per_param']:.1f} B/param roofline {_fraction(row.get('roofline_fraction'))}")
        if row.get("roofline_bound"):
            text += f" ({row['roofline_bound']})"
        if "vs_one_gpu" in row:
            text += f" | x{row['vs_one_gpu']:.2f} of 1 GPU, host {row['host_gib']:.1f} GiB"
    for key in ("vs_resident", "vs_deepspeed", "vs_streamed"):
        if key in row:
            text += f" | {key} {row[key]:.2f}"
    return text


if __name__ == "__main__":
    sys.exit(main())
