"""The driver's side of data parallelism: how many ranks on which Ray nodes, each rank's slice of a
step's batch, and one StepResult from theirs. The engine's side (the gradient sums, the per-stage
counters) is megatrain_ray/engine/collective.py.

A step's global batch is the same whatever the number of GPUs: rank r takes rows
[r B/N, (r+1) B/N) of it, and every rank divides its loss by the loss tokens of the whole batch, so
the summed gradients are those of the single-GPU step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatrain_ray.config.sections import Config, check_parallel
from megatrain_ray.data.preference import split_pairs
from megatrain_ray.engine.collective import RankInfo
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.messages import Batch, StepResult


@dataclass(frozen=True, slots=True)
class ParallelPlan:
    """Where a run's ranks go: `node_ids[k]` is node k's Ray node (None: wherever its placement group
    fits, the single-node case), with `ranks_per_node` GPU workers on each."""

    node_ids: tuple[str | None, ...] = (None,)
    ranks_per_node: int = 1
    use_gpu: bool = False
    backend: str = "gloo"
    same_host: bool = True
    """Every node on one machine (one node, or several Ray nodes of one box in tests): the ranks meet
    through a file in shared memory and bind no socket beyond 127.0.0.1."""
    node_resources: tuple[dict[str, float] | None, ...] = (None,)

    @property
    def nodes(self) -> int:
        return len(self.node_ids)

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node

    def rank(self, node: int, local_rank: int) -> RankInfo:
        return RankInfo.of(node, local_rank, self.ranks_per_node, self.nodes)

    def describe(self) -> str:
        if self.world == 1:
            return "1 GPU worker"
        return (f"{self.world} GPU workers ({self.ranks_per_node} per node on {self.nodes} node(s), "
                f"{'GPUs' if self.use_gpu else 'CPU'}, {self.backend})")


def resolve_parallel(cfg: Config) -> ParallelPlan:
    """The ranks and nodes of a run; in Ray mode from the cluster's nodes (Ray must be initialised)."""
    p = cfg.parallel
    rollout_gpus = int(cfg.rl.separate)  # GRPO's rollout worker: one GPU more (config/sections.check_rl)
    if cfg.runtime.mode == "local":  # one rank (the config check refused more in-process), on this process's GPU
        if cfg.engine.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("engine.device=cuda but CUDA is not available to this process; set engine.device=auto "
                              "or cpu")
        use_gpu = cfg.engine.device != "cpu" and torch.cuda.is_available()
        if use_gpu and rollout_gpus:
            raise ConfigError("rl.rollout=separate puts the rollout worker on a GPU of its own, which Ray assigns: set "
                              "runtime.mode: ray (or rl.rollout: colocated)")
        return ParallelPlan(use_gpu=use_gpu)
    import ray

    has_gpu = ray.cluster_resources().get("GPU", 0) >= 1
    if cfg.engine.device == "cuda" and not has_gpu:
        raise ConfigError("engine.device=cuda but the Ray cluster offers no GPU; set engine.device=auto")
    use_gpu = has_gpu and cfg.engine.device != "cpu"
    alive = [n for n in ray.nodes() if n.get("Alive")]
    gpus_of = {n["NodeID"]: int(n["Resources"].get("GPU", 0)) for n in alive}
    wanted = p.gpus // p.nodes if p.gpus != "auto" else None
    if p.nodes == 1:
        most = max(gpus_of.values(), default=0)
        extra = rollout_gpus if use_gpu else 0
        per_node = wanted if wanted is not None else (max(1, most - extra) if use_gpu else 1)
        if use_gpu and per_node + extra > most:
            if extra:
                raise ConfigError(f"rl.rollout=separate: the trainer's {per_node} GPU(s) and one for the rollout "
                                  f"worker need a node with {per_node + extra} GPUs, and the largest of the Ray "
                                  f"cluster has {most}; set rl.rollout: colocated, or add a GPU")
            raise ConfigError(f"parallel.gpus={p.gpus}: no node of the Ray cluster offers {per_node} GPUs (the "
                              f"largest has {most}); lower parallel.gpus or spread it with parallel.nodes")
        chosen: list[dict] = []
    else:
        here = ray.get_runtime_context().get_node_id()  # node 0, whose shards write checkpoints, is the driver's
        fit = sorted((n for n in alive if not use_gpu or gpus_of[n["NodeID"]] >= (wanted or 1)),
                     key=lambda n: n["NodeID"] != here)
        if len(fit) < p.nodes:
            need = f"with {wanted or 1} GPU(s) each " if use_gpu else ""
            raise ConfigError(f"parallel.nodes={p.nodes}: the Ray cluster has {len(fit)} alive node(s) {need}"
                              f"(of {len(alive)}); add nodes or lower parallel.nodes")
        chosen = fit[:p.nodes]
        per_node = wanted if wanted is not None else (min(gpus_of[n["NodeID"]] for n in chosen) if use_gpu else 1)
    check_parallel(cfg, per_node * p.nodes)
    backend = p.backend if p.backend != "auto" else ("nccl" if use_gpu else "gloo")
    if backend == "nccl" and not use_gpu and per_node * p.nodes > 1:
        raise ConfigError("parallel.backend=nccl needs GPUs and the run has none; use gloo or auto")
    if not chosen:
        return ParallelPlan((None,), per_node, use_gpu, backend)
    return ParallelPlan(tuple(n["NodeID"] for n in chosen), per_node, use_gpu, backend,
                        same_host=len({n["NodeManagerAddress"] for n in chosen}) == 1,
                        node_resources=tuple(dict(n["Resources"]) for n in chosen))


def split_batch(batch: Batch, ranks: int) -> tuple[list[Batch], int]:
    """Each rank's rows of a step's batch, and the loss tokens of the whole batch, by which every rank
    divides (one rank: the batch itself, untouched)."""
    total = batch.loss_tokens
    if ranks == 1:
        return [batch], total
    if batch.preference is not None:  # DPO: whole pairs per rank
        return split_pairs(batch, ranks), total
    if batch.policy is not None:  # its per-rank metrics (minima, maxima, means over a rank's tokens) do not add up
        raise ConfigError(f"finetune.objective=grpo trains on one GPU worker in this version; this run has {ranks} "
                          "(parallel.gpus x parallel.nodes): set parallel.gpus: 1 and parallel.nodes: 1")
    rows = batch.input_ids.shape[0] // ranks

    def part(r: int) -> Batch:
        cut = slice(r * rows, (r + 1) * rows)
        return Batch(batch.input_ids[cut].contiguous(), batch.labels[cut].contiguous(),
                     None if batch.positions is None else batch.positions[cut].contiguous(),
                     None if batch.segments is None else batch.segments[cut])
    return [part(r) for r in range(ranks)], total


def merge_results(results: list[StepResult]) -> StepResult:
    """One StepResult for the step from its ranks': the loss and norm they all agree on; tokens and bytes
    summed; wall times of the slowest rank; compute time per GPU (the mean), so that compute / step time
    stays a GPU's busy fraction; H2D and D2H times summed, so that bytes / time stays the mean rate of one
    link; GPU memory of the fullest; optimizer figures from the ranks that ordered updates (the others
    report none)."""
    if len(results) == 1:
        return results[0]
    first = results[0]
    total = lambda key: sum(getattr(r, key) for r in results)  # noqa: E731
    slowest = lambda key: max(getattr(r, key) for r in results)  # noqa: E731
    return StepResult(
        loss=first.loss, grad_norm=first.grad_norm, tokens=total("tokens"), valid_tokens=first.valid_tokens,
        seconds=slowest("seconds"), update_wait_seconds=slowest("update_wait_seconds"),
        optimizer_seconds=slowest("optimizer_seconds"), optimizer_bytes=total("optimizer_bytes"),
        h2d_bytes=total("h2d_bytes"), d2h_bytes=total("d2h_bytes"),
        compute_seconds=total("compute_seconds") / len(results), h2d_seconds=total("h2d_seconds"),
        d2h_seconds=total("d2h_seconds"), skipped=first.skipped, gpu_peak_bytes=slowest("gpu_peak_bytes"),
        comm_seconds=slowest("comm_seconds"), vision_seconds=slowest("vision_seconds"),
        device_update_seconds=total("device_update_seconds") / len(results),
        slab_wait_seconds=slowest("slab_wait_seconds"),
        rank_update_wait_seconds=tuple(r.update_wait_seconds for r in results),
        objective_metrics={k: sum(r.objective_metrics[k] for r in results) for k in first.objective_metrics}
        if first.objective_metrics else None,  # each rank's share of the mean over the whole batch
        aux_loss=first.aux_loss,  # MoE: the whole batch's, the same on every rank
        speculative_redone=first.speculative_redone)
