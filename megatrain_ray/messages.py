"""Small messages between the actors: control only, never bulk tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

IGNORE_INDEX = -100
"""Label of a token that does not count towards the loss (prompt, padding), as in Hugging Face."""


@dataclass(frozen=True, slots=True)
class UpdateOrder:
    """Sent to every OptimizerWorker once a stage's gradients are on the host."""

    stage: int
    grad_kind: str
    """Segment kind holding the gradients: `stream`, `grad` or `gradpool`."""
    grad_index: int
    """Stage index (stream, grad) or slab number (gradpool)."""
    adam_step: int
    """1-based count of updates, for the bias corrections."""
    lr: float
    grad_coef: float = 1.0
    """Gradients are multiplied by this before the update (the clipping coefficient)."""
    apply: bool = True
    """False drops the update (non-finite gradients): the worker only rewrites the streaming copy,
    which the gradients overwrote, from the untouched master weights."""
    span: tuple[int, int] | None = None
    """Only elements [start, end) of the stage, whose gradients sit at the start of a slab (a stage larger
    than the slabs goes through them in pieces: host.vocab_in_pieces); None: the whole stage, each
    element's gradient at its own offset."""
    speculative: Literal["update", "redo"] | None = None
    """update: ordered before the step's gradient norm is known (optimizer.speculative_stages), it writes the
    stage's other set of master and moments (store.segments.ALT_KINDS) and saves the gradients it read; the
    set becomes current once the norm says no clipping. redo: the norm clipped (or the step is dropped): update
    the current set again, the gradients read from where the speculative update saved them."""


@dataclass(frozen=True, slots=True)
class UpdateDone:
    stage: int
    worker: int
    seconds: float
    elems: int
    dram_bytes: int
    """Bytes the update read and wrote in host memory (counted from the kernel's data flow)."""
    started: float = 0.0
    ended: float = 0.0
    """time.perf_counter() at the update's start and end (CLOCK_MONOTONIC on Linux: comparable across the
    processes of a host; engine.update_trace)."""


@dataclass(slots=True)
class StepResult:
    """What the GPU worker reports after one optimizer step's forward and backward."""

    loss: float
    grad_norm: float
    tokens: int
    valid_tokens: int
    seconds: float
    """Wall time of the step on the GPU worker, from its start to the last gradient handed over."""
    update_wait_seconds: float
    """Time the issuing thread waited for optimizer updates (of this step's or the previous one's)."""
    optimizer_seconds: float
    """Time of the updates this step collected, each stage counted once (its slowest worker)."""
    optimizer_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    compute_seconds: float
    """Device time of the compute kernels (timing events around each stage)."""
    h2d_seconds: float
    d2h_seconds: float
    skipped: bool = False
    """True when the gradients were not finite and the update was dropped."""
    gpu_peak_bytes: int = 0
    comm_seconds: float = 0.0
    """Time the compute stream spent in the gradient sums over the ranks (data parallel only)."""
    slab_wait_seconds: float = 0.0
    """Of update_wait_seconds, the waits before copying gradients into a host slab whose last update had not
    finished (in the backward); the rest waited to load a stage's updated weights."""
    rank_update_wait_seconds: tuple[float, ...] = ()
    """update_wait_seconds of each rank (data parallel; merge_results), the first rank first."""
    objective_metrics: dict[str, float] | None = None
    """Metrics of the training objective beyond the loss (DPO: rewards/chosen, rewards/margins, ...); None for SFT."""
    aux_loss: float | None = None
    """MoE with model.output_router_logits: the load-balancing loss (unweighted; `loss` includes
    router_aux_loss_coef times it, as transformers' loss does). None otherwise."""
    speculative_redone: int | None = None
    """Speculative updates of the step redone after the norm (it clipped or was dropped); None: none speculated."""


@dataclass(frozen=True, slots=True)
class ActorStatus:
    """An actor's answer to heartbeat(): alive, and where it runs."""

    pid: int
    cores: tuple[int, ...]
    """The CPUs the process may run on (os.sched_getaffinity), i.e. its pinning."""
    resources: dict[str, float]
    """Ray resources assigned to the actor (its placement-group bundle); empty in-process."""


@dataclass(frozen=True, slots=True)
class PreferenceRows:
    """What makes a batch a DPO batch (finetune.objective=dpo): its 2P rows are P pairs, the chosen rows first and
    the rejected rows after them in the same pair order; the loss is megatrain_ray/model/preference.py's."""

    reference_logps: torch.Tensor
    """[2P] float64: each row's completion log-probability under the reference (initial) model."""
    beta: float
    label_smoothing: float
    loss_type: str
    total_pairs: int = 0
    """Pairs in the whole step's batch when the ranks of a data-parallel run share it (each divides by it, so
    the ranks' sums add up to the mean over all pairs); 0: this batch's own pairs."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One step's inputs, sent by the driver to the GPU worker (small: token ids, not weights)."""

    input_ids: torch.Tensor
    """[batch, seq_len] int64."""
    labels: torch.Tensor
    """[batch, seq_len] int64: the next token where it counts towards the loss, -100 elsewhere."""
    positions: torch.Tensor | None = None
    """[batch, seq_len] RoPE position of each token within its document; None means 0..seq_len-1."""
    segments: tuple[tuple[int, ...], ...] | None = None
    """Packed rows: per row, the lengths of its documents (they sum to seq_len); attention stays inside
    each. None: every row is one sequence (no per-document work at all)."""
    preference: PreferenceRows | None = None
    """DPO: the rows are preference pairs (the head computes the DPO loss); None: cross-entropy."""

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor) -> Batch:
        """A [batch, seq_len + 1] window of a token stream: inputs and their shifted labels."""
        return cls(tokens[:, :-1], tokens[:, 1:])

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())
