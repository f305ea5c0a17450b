"""The plan's lines about the GPU-resident tier (engine.gpu_resident, engine.kept_activations): which stages live on
the GPU, their memory, the layers whose forward graphs are kept, and why engine.gpu_resident=auto chose that."""

from __future__ import annotations

import dataclasses

from megatrain_ray.config.resolved import resident_tier_refusal
from megatrain_ray.model.layout import build_layout
from megatrain_ray.planning.gpu_memory import resolve_gpu_resident
from megatrain_ray.planning.plan import Plan
from megatrain_ray.planning.speed import GPU_ADAMW_GBPS, estimate
from megatrain_ray.units import GiB, human_count


def resident_lines(plan: Plan) -> list[str]:
    """The GPU-resident tier (engine.gpu_resident other than none): which stages, their GPU memory, the layers whose
    forward graphs are kept (no recompute), the expected tok/s with and without them (the speed model: no copies and
    no CPU update for them), and why auto chose what it chose."""
    cfg, run, g = plan.cfg, plan.run, GiB
    if cfg.engine.gpu_resident == "none":
        return []
    layout = build_layout(cfg.model)
    stages = layout.resident_stages(run.resident_layers)
    head = f"GPU-resident tier (engine.gpu_resident={cfg.engine.gpu_resident}): "
    profile = plan.profile
    if not stages:
        fits = resolve_gpu_resident(cfg, run, plan.machine.gpu_memory)[0] if cfg.engine.gpu_resident == "auto" else 0
        if fits and profile is not None:  # it fits, but the speed model says streaming is faster
            fit_run = dataclasses.replace(run, resident_layers=fits)
            why = (f"{fits} layers would fit, but the speed model predicts "
                   f"{estimate(cfg, profile, offload=plan.offload, run=fit_run).tok_per_s:,.0f} tok/s with them "
                   f"against {plan.expected.tok_per_s:,.0f} streamed")
        else:
            why = resident_tier_refusal(cfg, run.world) or ("no GPU" if not plan.machine.gpu_memory
                                                            or cfg.engine.device == "cpu" else
                                                            "no layer fits the GPU memory the plan leaves")
        return [head + f"none ({why})", ""]
    params = sum(s.numel for s in layout.resident_stages(run.resident_layers, run.resident_vocab))
    tier = plan.gpu["GPU-resident layers"]
    first, last = stages[0].index - 1, stages[-1].index - 1
    where = ("the frozen base, copied once from the host store (which keeps it), no H2D for them" if run.frozen_base
             else "no host copy: the GPU worker checkpoints and exports them")
    count = f"{len(stages)} of {len(layout.layers)}"
    which = f"({count}) with the embedding and LM head ({human_count(params)} params)" if run.resident_vocab else \
        f"({count}, {human_count(params)} params)"
    lines = [head + f"layers {first}-{last} {which}: {tier / g:.2f} GiB of GPU memory ({tier / params:.1f} B/param); "
             f"{where}"]
    if cfg.engine.gpu_resident == "auto" and not run.frozen_base:
        lines.append("  chosen: " + ("every layer and the embedding and LM head fit" if run.resident_vocab else
                                     "every layer fits, the embedding and LM head do not" + (
                                         " (GRPO's rollout streams them)" if cfg.finetune.objective == "grpo" else "")
                                     if len(stages) == len(layout.layers) else
                                     "as many layers as fit the GPU memory the plan leaves")
                     + (", and the speed model predicts it faster than streaming"
                        if profile is not None and not plan.expected.below_resolution else ""))
    if not run.frozen_base:
        kept = layout.kept_stages(run.resident_layers, run.kept_layers)
        graphs = plan.gpu.get("kept layer graphs", 0)
        lines.append(f"  kept forward graphs (engine.kept_activations={cfg.engine.kept_activations}): " + (
            f"layers {kept[0].index - 1}-{kept[-1].index - 1} ({len(kept)}), {graphs / g:.2f} GiB: their backward "
            "recomputes nothing" if kept else "none: every layer recomputes its forward in the backward")
            + (" (as many as fit the GPU memory left)" if cfg.engine.kept_activations == "auto" else ""))
    if profile is not None:
        without = estimate(cfg, profile, offload=plan.offload, resident=0, run=run)
        lines.append(f"  expected {plan.expected.speed_text} with them, {without.speed_text} with every stage streamed"
                     + ("" if run.frozen_base else f" (their updates on the GPU at "
                                                   f"{GPU_ADAMW_GBPS[profile.gpu.kind]:g} GB/s, an assumption)"))
    return [*lines, ""]
