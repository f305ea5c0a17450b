"""The memory plan as `megatrain plan` prints it: the host, disk and GPU figures (`format_plan`), the memory
tiers to pick from (`tier_lines`), the GPU-resident tier, the time a stop takes, and the changes that shrink
a host store that does not fit (`host_fixes`)."""

from __future__ import annotations

import dataclasses

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.sections import Config
from megatrain_ray.model.flops import active_params
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.lora import lora_params
from megatrain_ray.planning.gpu_memory import GPU_RESERVE_BYTES
from megatrain_ray.planning.host_memory import store_bytes, without_refused_tier
from megatrain_ray.planning.lean import lean_alternatives, lean_lines
from megatrain_ray.planning.lora import LORA_ADAPTERS, lora_tier_lines
from megatrain_ray.planning.plan import Plan
from megatrain_ray.planning.resident_text import resident_lines
from megatrain_ray.planning.rollout import rollout_lines
from megatrain_ray.planning.speculation import fastest_speculation
from megatrain_ray.planning.profiles import PRESETS, REFERENCE_OPTIMIZER_BYTES
from megatrain_ray.planning.speed import estimate
from megatrain_ray.planning.speed_estimate import SHORTEST_CHECKED_STEP_S, SpeedEstimate
from megatrain_ray.planning.vision import VISION_KEYS, vision_lines
from megatrain_ray.store.disk_use import export_bytes, export_dtype
from megatrain_ray.units import GiB, human_count

GRAD_HOMES = {"stream": "gradients land in the streaming copy", "stage": "gradients in per-stage buffers",
              "pool": "gradients in a pool of layer-sized slabs"}
"""Where the GPU's gradients land on the host (RunSpec.grad_home), as plan prints it."""

_LABELS = {"master": "master weights", "exp_avg": "AdamW first moment", "exp_avg_sq": "AdamW second moment",
           "stream": "streaming copy", "grad": "gradients (per stage)", "gradpool": "gradient slabs",
           "gate": "checkpoint gates", "sync": "data-parallel counters", "nf4": "frozen base layers (NF4)",
           "alt_master": "second set: master weights", "alt_exp_avg": "second set: 1st moment",
           "alt_exp_avg_sq": "second set: 2nd moment", "saved_grad": "saved gradients", "parity": "set parities",
           "master_comp": "master compensation (lean)", "exp_avg_scale": "1st moment block scales",
           "exp_avg_sq_scale": "2nd moment block scales", "reference": "GRPO KL reference (initial)"}


CHECKPOINT_WRITE_GBPS = 1.0
"""Disk write rate assumed for the stop time: a checkpoint is one sequential write per stage file."""


def format_plan(plan: Plan) -> str:
    cfg, machine, run, g = plan.cfg, plan.machine, plan.run, GiB
    layout = build_layout(cfg.model)
    n_active = active_params(cfg.model, layout)  # a MoE model's, native or generic (its routed experts' top-k)
    active = f" ({human_count(n_active)} active per token)" if n_active < layout.num_params else ""
    lines = [f"megatrain plan: {cfg.model.family}, {human_count(layout.num_params)} parameters{active}"
             + ("" if cfg.model.path else " (random init: model.path is empty)") + ", "
             f"{cfg.model.num_layers} layers, {cfg.data.tokens_per_step:,} tokens/step "
             f"(batch {cfg.data.batch_size} x {cfg.data.seq_len})",
             f"machine{' (as described)' if machine.described else ''}: {machine.host_memory / g:.1f} GiB RAM "
             f"({machine.host_available / g:.1f} available), {machine.shm_free / g:.1f} GiB free in "
             f"{cfg.host.shm_dir}, GPU "
             + (f"{machine.gpu_name or ''} {machine.gpu_memory / g:.1f} GiB".strip() if machine.gpu_memory
                else "none visible"),
             *([f"data parallel: {run.ranks_per_node} GPU(s) on each of {run.nodes} node(s), "
                f"{cfg.data.batch_size // run.world} rows per GPU: host figures per "
                "node, GPU figures per GPU"] if run.world > 1 else []),
             "", "host (shared memory, per kind):"]
    dtypes = {"master": run.master_dtype, "exp_avg": run.moment_dtype, "exp_avg_sq": run.moment_dtype,
              "stream": run.stream_dtype, "reference": run.stream_dtype, "nf4": "nf4", "alt_master": run.master_dtype,
              "alt_exp_avg": run.moment_dtype, "alt_exp_avg_sq": run.moment_dtype,
              "master_comp": run.master_dtype, "exp_avg_scale": "float32", "exp_avg_sq_scale": "float32"}
    if run.optimizer_state == "lean" and run.lean_block:
        dtypes.update(exp_avg="int8", exp_avg_sq="int8")  # 8-bit codes (stored as uint8 bytes)
    for kind, nbytes in plan.host.items():
        if nbytes >= 2**20:
            label = (("frozen embedding, LM head" if run.base_quantization == "nf4" else "frozen base (streamed)")
                     if run.frozen_base and kind == "master" else _LABELS[kind])
            lines.append(f"  {label:<28}{dtypes.get(kind, run.grad_dtype):>9} {nbytes / g:10.2f} GiB")
    params = layout.num_params
    lines += [f"  {'shared memory total':<38}{plan.shm_total / g:10.2f} GiB  ({plan.shm_total / params:.1f} B/param)"]
    if plan.disk:
        lines.append(f"  {'disk-tier staging (optimizers)':<38}{plan.staging / g:10.2f} GiB")
    lines += [f"  {'processes (driver, actors)':<38}{plan.processes / g:10.2f} GiB  (estimate)",
              *([f"  {'offloaded layer inputs (pinned)':<38}{plan.offloaded / g:10.2f} GiB"] if plan.offload else []),
              f"  {'host RAM total':<38}{plan.host_total / g:10.2f} GiB  ({plan.host_total / params:.1f} B/param)",
              pinned_line(plan), ""]
    if plan.disk:
        lines.append(f"disk (host.disk_dir={cfg.host.disk_dir}):")
        for kind, nbytes in plan.disk.items():
            lines.append(f"  {_LABELS[kind]:<28}{dtypes[kind]:>9} {nbytes / g:10.2f} GiB")
        total = sum(plan.disk.values())
        lines += [f"  {'disk total':<38}{total / g:10.2f} GiB  ({total / 1e9:.1f} GB)", ""]
    lines += [*tier_lines(plan), "",
              f"{'GPU' if plan.on_gpu else f'compute device: the CPU, {cpu_reason(plan)}'} (torch allocations; layer "
              f"inputs {'offloaded to host' if plan.offload else 'kept on the device'}, "
              f"engine.activation_offload={str(cfg.engine.activation_offload).lower()}):"]
    for name, nbytes in plan.gpu.items():
        lines.append(f"  {name:<38}{nbytes / g:10.2f} GiB")
    fixed = sum(plan.gpu.get(k, 0) for k in ("weight buffers", "gradient buffers", "vocabulary accumulator",
                                             "GPU-resident layers", LORA_ADAPTERS, *VISION_KEYS))
    per_token = (plan.gpu_peak - fixed) / run.rank_tokens
    lines += [f"  {'peak allocated':<38}{plan.gpu_peak / g:10.2f} GiB",
              f"  {'+ context, workspaces, fragmentation':<38}{GPU_RESERVE_BYTES / g:10.2f} GiB",
              f"  {'activations per token (one GPU)':<38}{per_token / 1024:10.1f} KiB"
              + (f"  (+ {plan.offloaded / run.ranks_per_node / run.rank_tokens / 1024:.1f} KiB pinned host RAM)"
                 if plan.offload else ""), ""]
    lines += vision_lines(cfg, plan.vision)
    lines += rollout_lines(cfg, run, machine.gpu_memory if plan.on_gpu else None, plan.gpu_peak)
    lines += resident_lines(plan)
    lines += speed_lines(cfg, plan.expected, gpu_visible=bool(machine.gpu_memory))
    lines += disk_lines(plan, params)
    lines += stop_lines(plan, params)
    lines.append("(what each line means: docs/reading-the-plan.md)")
    if plan.fits:
        lines.append("fits.")
    else:
        lines += ["does NOT fit:", *(f"  - {p}" for p in plan.problems)]
        if plan.host_fixes:
            lines += ["to shrink the host store (each change on its own):",
                      *(f"  - {fix}" for fix in plan.host_fixes)]
    return "\n".join(lines) + "\n"


def cpu_reason(plan: Plan) -> str:
    """Why the layers compute on the CPU (a plan with on_gpu False)."""
    return "engine.device=cpu" if plan.cfg.engine.device == "cpu" else "no GPU visible"


def pinned_line(plan: Plan) -> str:
    """The host RAM the GPU worker registers as pinned memory; none when the layers compute on the CPU."""
    run = plan.run
    if not plan.on_gpu:
        return (f"  {'of which pinned':<38}{0:10.2f} GiB  ({cpu_reason(plan)}: the layers compute on the CPU, "
                "nothing is pinned)")
    return (f"  {'of which pinned for the GPU':<38}{plan.pinned / GiB:10.2f} GiB  "
            f"({'the frozen base, streamed as it is' if run.frozen_base else GRAD_HOMES[run.grad_home]})")


def tier_lines(plan: Plan) -> list[str]:
    """The host RAM of the configured memory tier, and what each other choice of moment format and tier
    would change (same shape, precision and workers): what `plan` prints for users to pick from."""
    cfg, g = plan.cfg, GiB
    params = build_layout(cfg.model).num_params
    if plan.run.frozen_base:
        return lora_tier_lines(plan, params)
    configured = (cfg.optimizer.moment_dtype, cfg.host.moments_tier)
    lean = cfg.optimizer.state == "lean"
    ram_now = plan.shm_total + plan.staging
    disk_now = sum(plan.disk.values())
    setting = f"optimizer.state=lean, lean_moments={cfg.optimizer.lean_moments}" if lean else \
        f"optimizer.moment_dtype={configured[0]}, host.moments_tier={configured[1]}"
    lines = [f"memory tiers ({setting}): "
             f"store {ram_now / g:.2f} GiB RAM ({ram_now / params:.1f} B/param)"
             + (f" + {disk_now / 1e9:.1f} GB disk ({disk_now / params:.1f} B/param)" if disk_now else "")]
    profile = plan.profile
    if profile is not None:
        lines[0] += f"; expected {plan.expected.speed_text}"
    alternatives = lean_alternatives(cfg)
    for dtype in () if lean else ("float32", "bfloat16") if cfg.precision.master_dtype == "float32" else ("float32",):
        for tier in ("ram", "disk"):
            if (dtype, tier) == configured:
                continue
            speculative = cfg.optimizer.speculative_stages if tier == "ram" else 0  # it needs the moments in RAM
            label = "moments" + (f" {dtype}" if dtype != configured[0] else "") \
                + ((" on disk" if tier == "disk" else " in RAM") if tier != configured[1] else "")
            alternatives.append((label, dataclasses.replace(
                cfg, optimizer=dataclasses.replace(cfg.optimizer, moment_dtype=dtype, speculative_stages=speculative),
                host=dataclasses.replace(cfg.host, moments_tier=tier, disk_dir=cfg.host.disk_dir or "DISK_DIR"))))
    # The streaming copy: its own bf16 copy in RAM, or the fp32 master streamed (RAM for PCIe bytes).
    stream = cfg.precision.master_dtype if not cfg.precision.stream_is_master else cfg.precision.compute_dtype
    if stream != cfg.precision.resolved_stream_dtype and not lean:
        streams_master = stream == cfg.precision.master_dtype  # and so no speculative updates
        alternatives.append((f"streaming copy {'none (master streamed)' if streams_master else stream}",
                             dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, stream_dtype=stream),
                                                 optimizer=dataclasses.replace(
                                                     cfg.optimizer, speculative_stages=0 if streams_master else
                                                     cfg.optimizer.speculative_stages))))
    # The second sets are shared memory: they must fit the RAM left and host.shm_dir.
    ram_left = min(plan.usable_host - plan.host_total, plan.machine.shm_free - plan.shm_total)
    def weigh(other: Config) -> tuple[int, float]:
        ram, _, tok_per_s = alternative_figures(plan, other)
        return ram, tok_per_s
    # no speculation advice where the speed model has no figure for this step (below_resolution)
    fastest = fastest_speculation(cfg, weigh, ram_left) \
        if profile is not None and not plan.expected.below_resolution else None
    if fastest is not None and fastest[0] != cfg.optimizer.speculative_stages:  # RAM for speed (clipping on)
        alternatives.append((f"speculative_stages {fastest[0]}", fastest[1]))
    for label, other in [(label, without_refused_tier(other)) for label, other in alternatives]:
        ram, disk, est = alternative_estimate(plan, other)
        d_ram, d_disk = ram - ram_now, disk - disk_now
        change = f"{d_ram / g:+.2f} GiB RAM" + (f", {d_disk / 1e9:+.1f} GB disk" if d_disk else "")
        speed = "" if est is None else f"  {'(no tok/s)' if est.below_resolution else f'{est.tok_per_s:9,.0f} tok/s'}"
        lines.append(f"  {label + ':':<40}{change:<34}{ram / params:5.1f} B/param RAM"
                     + speed + ("  (not full precision)" if other.optimizer.moment_dtype == "bfloat16"
                                or other.optimizer.state == "lean" else "")
                     + ("  (no speculative updates)" if cfg.optimizer.speculative_stages
                        and not other.optimizer.speculative_stages else ""))
    lines += [f"  {line}" for line in lean_lines(cfg, plan.host, params, profile.host if profile else None)]
    if profile is not None:
        lines.append(f"  (tok/s: the speed model; AdamW scaled by DRAM bytes per parameter, the disk tier at "
                     f"{profile.host.disk_gbps:g} GB/s read + write, an assumption unless --disk-gbps)")
    return lines


def disk_lines(plan: Plan, params: int) -> list[str]:
    """What the run leaves on disk: one checkpoint, the ones checkpoint.keep keeps (and one more while a newer is
    written), the export in the format train.export_dtype resolves to."""
    cfg, g = plan.cfg, GiB
    ck, steps = cfg.checkpoint, cfg.train.steps
    one = plan.run.checkpoint_bytes(params, lora_params(cfg))
    saves = (steps - 1) // ck.every if ck.every else 0  # checkpoint.every's saves before the last step
    saves += 1 if ck.at_end else 0
    kept = min(ck.keep, saves)
    where = ck.dir or f"{cfg.train.output_dir}/checkpoints"
    what = "float32 adapters, both AdamW moments" if plan.run.frozen_base else "master weights, both AdamW moments"
    lines = [f"run outputs on disk (checkpoints in {where}" + (f", export in {cfg.train.export_dir}):"
                                                                if cfg.train.export_dir else
                                                                "; no export: train.export_dir is empty):"),
             f"  {'one checkpoint':<38}{one / g:10.2f} GiB  ({what})"]
    if kept:
        lines.append(f"  {f'kept: {kept} (checkpoint.keep={ck.keep})':<38}{kept * one / g:10.2f} GiB  "
                     f"(of {saves} save(s) in {steps} steps"
                     + (f"; {kept + 1} for a moment while a newer one is written" if saves > kept else "") + ")")
    else:
        lines.append(f"  {'kept':<38}{0:10.2f} GiB  (checkpoint.every=0 and checkpoint.at_end=false: a checkpoint "
                     "only on a stop signal)")
    total = kept * one
    if cfg.train.export_dir:
        dtype, why = export_dtype(cfg.train.export_dtype, cfg.model.path or None)
        size = export_bytes(params, dtype, lora_params(cfg) if plan.run.frozen_base else 0)
        total += size
        lines.append(f"  {f'export ({dtype})':<38}{size / g:10.2f} GiB  ({why}"
                     + ("; train.export_dtype=bfloat16 halves it)" if dtype == "float32" else ")"))
    return [*lines, f"  {'on disk at the end':<38}{total / g:10.2f} GiB", ""]


def stop_lines(plan: Plan, params: int) -> list[str]:
    """How long a stop takes (SIGTERM: finish the step, write a checkpoint), for RAY_JOB_STOP_WAIT_TIME_S."""
    checkpoint = plan.run.checkpoint_bytes(params, lora_params(plan.cfg))
    write_s = checkpoint / (CHECKPOINT_WRITE_GBPS * 1e9)
    step_s = plan.expected.step_seconds if plan.expected else None
    wait_s = int(2 * (write_s + (step_s or 60.0))) + 30
    return [f"stop (SIGTERM, ray job stop): the step ends ({f'~{step_s:.1f} s' if step_s else 'its time: 60 s assumed'}), "
            f"then a "
            f"checkpoint of {checkpoint / 1e9:.1f} GB (~{write_s:.0f} s at {CHECKPOINT_WRITE_GBPS:g} GB/s, an assumption); "
            f"submit with RAY_JOB_STOP_WAIT_TIME_S={wait_s} in the job's runtime env", ""]


def alternative_run(plan: Plan, other: Config) -> RunSpec:
    """An alternative config's settings on the plan's machine: engine.gpu_resident=auto as the plan resolved it
    (RunSpec.resolve alone, without the machine, reads it as 0), unless the alternative drops the tier."""
    run = RunSpec.resolve(other)
    if other.engine.gpu_resident == "auto":
        return dataclasses.replace(run, resident_layers=plan.run.resident_layers, resident_vocab=plan.run.resident_vocab,
                                   kept_layers=plan.run.kept_layers)
    return run


def alternative_store(plan: Plan, other: Config) -> tuple[int, int, RunSpec]:
    """Host RAM (store and disk-tier staging) and disk bytes of an alternative to the plan's config on its
    machine, and its settings there (alternative_run)."""
    run = alternative_run(plan, other)
    ram, disk, staging = store_bytes(other, run, plan.workers)
    return sum(ram.values()) + staging, sum(disk.values()), run


def alternative_figures(plan: Plan, other: Config) -> tuple[int, int, float]:
    """alternative_store's RAM and disk bytes, and the alternative's expected tok/s (0 without measured rates)."""
    ram, disk, est = alternative_estimate(plan, other)
    return ram, disk, est.tok_per_s if est is not None else 0.0


def alternative_estimate(plan: Plan, other: Config) -> tuple[int, int, SpeedEstimate | None]:
    """alternative_store's RAM and disk bytes, and the alternative's speed estimate (None without measured rates)."""
    ram, disk, run = alternative_store(plan, other)
    return ram, disk, estimate(other, plan.profile, offload=plan.offload, run=run) if plan.profile else None


def host_fixes(plan: Plan) -> list[str]:
    """The changes that shrink the host store, each with the RAM it saves on its own, computed from the
    store this config would have (so a change that saves nothing here is left out: with clipping on,
    the streaming copy doubles as the gradients' landing place, and streaming the master keeps it)."""
    cfg, g = plan.cfg, GiB
    precision, optimizer, host = cfg.precision, cfg.optimizer, cfg.host
    candidates = []
    if plan.run.frozen_base:  # LoRA: the store is the base in the streaming dtype, nothing else to drop
        return ["train a smaller model, or use a machine with more RAM"]
    # Speculative updates need the streaming copy and the moments in RAM: the fixes that drop those drop them too.
    unspeculative = dataclasses.replace(optimizer, speculative_stages=0)
    also = " and optimizer.speculative_stages=0" if optimizer.speculative_stages else ""
    if optimizer.speculative_stages:
        candidates.append(("optimizer.speculative_stages=0 (no second sets of state; the updates wait for the "
                           "gradient norm)", dataclasses.replace(cfg, optimizer=unspeculative)))
    if not precision.stream_is_master:
        candidates.append((f"precision.stream_dtype={precision.master_dtype}{also} (stream the master weights: no "
                           "separate streaming copy, twice the PCIe bytes per step)",
                           dataclasses.replace(cfg, optimizer=unspeculative, precision=dataclasses.replace(
                               precision, stream_dtype=precision.master_dtype))))
    if optimizer.state == "lean":  # the precision and tier keys are fixed by the lean state (config.check_lean)
        candidates = [(f"{label.replace('state', 'optimizer.state', 1)} (not full precision)", other)
                      for label, other in lean_alternatives(cfg) if other.optimizer.lean_moments == "int8"
                      and other.optimizer.state == "lean"]
    elif precision.master_dtype == "float64":
        candidates.append(("precision.master_dtype=float32", dataclasses.replace(
            cfg, precision=dataclasses.replace(precision, master_dtype="float32"))))
    else:
        if optimizer.moment_dtype == "float32":
            candidates.append(("optimizer.moment_dtype=bfloat16 (not full precision)", dataclasses.replace(
                cfg, optimizer=dataclasses.replace(optimizer, moment_dtype="bfloat16"))))
        if host.moments_tier == "ram":
            candidates.append((f"host.moments_tier=disk with host.disk_dir on an NVMe disk{also} (slower: see the "
                               "memory tiers above)", dataclasses.replace(cfg, optimizer=unspeculative,
                                                                          host=dataclasses.replace(
                                   host, moments_tier="disk", disk_dir=host.disk_dir or "DISK_DIR"))))
    if optimizer.state == "full":
        candidates += [("optimizer.state=lean with optimizer.lean_moments=int8 (a bf16 master with its compensation, "
                        "8-bit moments; not full precision)", other) for label, other in lean_alternatives(cfg)
                       if other.optimizer.lean_moments == "int8"]
    ram_now = plan.shm_total + plan.staging
    fixes = []
    for text, other in [(text, without_refused_tier(other)) for text, other in candidates]:
        saved = ram_now - alternative_store(plan, other)[0]
        if saved >= GiB // 100:
            fixes.append(f"{text}: saves {saved / g:.1f} GiB")
    fixes.append("train a smaller model, or use a machine with more RAM (`megatrain plan --host-memory 1TB` shows "
                 "what a larger one needs)")
    return fixes


def format_speed(est: SpeedEstimate) -> list[str]:
    """The plan's speed lines for an estimate."""
    p = est.profile
    return [
        f"expected speed: a prediction of megatrain_ray/planning/speed.py from measured rates, clipping "
        f"{'on' if est.clip else 'off'}",
        f"  {'tok/s':<38}{est.tok_per_s:10,.0f}      ({est.model_tflops:.0f} model TFLOPS, {est.step_seconds:.2f} s/step)"
        if not est.below_resolution else
        f"  {'tok/s':<38}{'not predicted':>13}   (a modeled step of {est.step_seconds * 1e3:.3g} ms: shorter than "
        f"any the speed model is checked on, {SHORTEST_CHECKED_STEP_S} s and up: in a step that short, costs it "
        "leaves out, each kernel's launch and the per-layer Python work, would decide the speed)",
        f"  {'GPU compute per step':<38}{est.compute_seconds:10.2f} s    ({p.gpu.kind.upper()}: "
        f"{p.gpu.tflops(est.compiled, est.moe, est.lora):.4g} model TFLOPS on busy time, "
        f"{'MoE layers' if est.moe else 'layers'} {'compiled' if est.compiled else 'eager'}"
        + (f", LoRA at {p.gpu.lora_rate_fraction:g} of that rate" if est.lora else "") + "; "
        f"busy {est.gpu_busy:.0%} of the step)",
        f"  {'H2D per step':<38}{est.h2d_seconds:10.2f} s    ({p.host.h2d_gbps:g} GB/s, "
        f"{p.host.h2d_loaded_gbps:g} while AdamW runs)",
        f"  {'D2H per step':<38}{est.d2h_seconds:10.2f} s    ({p.host.d2h_gbps:g} GB/s)",
        f"  {'CPU AdamW per step':<38}{est.optimizer_seconds:10.2f} s    ({est.optimizer_gparams:.3g} G params/s"
        + (f"; {p.host.adamw_gparams:g} measured at {REFERENCE_OPTIMIZER_BYTES} B/param, "
           + ("times the lean state's measured fraction" if est.lean else "scaled by DRAM bytes")
           if abs(est.optimizer_gparams - p.host.adamw_gparams) > 1e-9 else "") + ")",
        f"  {'bound by':<38}{est.bound}   (GPU idle "
        + ", ".join(f"{s:.2f} s on {what}" for what, s in est.gpu_waits.items()) + ")",
        f"  rates from: GPU {p.gpu.source}; host {p.host.source}",
        *(f"  assumption: {a}" for a in p.assumptions),
    ]


def speed_lines(cfg: Config, expected: SpeedEstimate | None, gpu_visible: bool = True) -> list[str]:
    """The speed part of `megatrain plan`: the estimate (Plan.expected), or why there is none."""
    if cfg.engine.device == "cpu":
        return []
    if expected is None:
        return [f"expected speed: no measured rates for {'this GPU' if gpu_visible else 'a machine without a GPU'}; "
                f"name a machine with --machine ({', '.join(PRESETS)})", ""]
    return [*format_speed(expected), ""]
