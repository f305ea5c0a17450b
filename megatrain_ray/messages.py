"""Small messages between the actors: control only, never bulk tensors."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

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
    vision_seconds: float = 0.0
    """A vision-language model: time the compute stream spent in its vision tower and projector (the features and
    their backward; not in compute_seconds)."""
    device_update_seconds: float = 0.0
    """Time the compute stream spent in optimizer updates on the device (the GPU-resident tier's, the LoRA adapters';
    not in compute_seconds). Those ordered after the step's last read (clipping on) are counted in the step that
    reads them done: the next one."""
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
    token_logps: torch.Tensor | None = None
    """GRPO (a Batch with `policy`): [rows, seq_len] log-probability of each label under the weights before the step,
    this rank's rows, on the host; 0 where labels == -100. float32 (float64 when computing in it). The driver keeps
    them as old_logps (num_iterations > 1) and compares them with the rollout's. None for other batches."""

    @property
    def busy_seconds(self) -> float:
        """Time the device spent computing in the step: the stages and the optimizer updates on the device (what
        gpu_busy divides by the step's time)."""
        return self.compute_seconds + self.device_update_seconds


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


LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True, slots=True)
class GRPOLossSettings:
    """The loss's settings, with the names of finetune.grpo (TRL's GRPOConfig)."""

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    """None: epsilon."""
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True
    max_completion_length: int = 512
    """dr_grpo's constant divisor per row."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown GRPO loss type {self.loss_type!r}; expected one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"unknown importance_sampling_level {self.importance_sampling_level!r}; expected one "
                             f"of {', '.join(IS_LEVELS)}")

    @classmethod
    def of(cls, grpo: Any) -> GRPOLossSettings:
        """From the config's finetune.grpo section (config/grpo_section.py: GRPOConfig)."""
        return cls(loss_type=grpo.loss_type, beta=grpo.beta, epsilon=grpo.epsilon, epsilon_high=grpo.epsilon_high,
                   importance_sampling_level=grpo.importance_sampling_level,
                   use_bias_correction_kl=grpo.use_bias_correction_kl,
                   max_completion_length=grpo.max_completion_length)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def epsilon_upper(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass(frozen=True, slots=True)
class PolicyRows:
    """What makes a batch a GRPO batch (finetune.objective=grpo): each row is a prompt and one sampled completion,
    its labels the next token where that is a completion token and -100 elsewhere (prompt, padding). The loss is
    TRL 1.16's GRPOTrainer._compute_loss (model/policy_gradient.py, in the head: model/policy_head.py).

    Every per-token tensor is [rows, seq_len], aligned with the labels (entry t belongs to label t) and read only
    where labels != -100 (anything, even NaN, elsewhere). The settings carry finetune.grpo's (TRL's) names."""

    advantages: torch.Tensor
    """[rows] float64: each completion's advantage."""
    sampling_logps: torch.Tensor | None = None
    """The rollout engine's log-probability of each sampled token (NaN: it could not score it); needed when
    vllm_importance_sampling_correction is on."""
    old_logps: torch.Tensor | None = None
    """The log-probabilities under the policy that generated the completions; None: on-policy, the head's own
    (detached), as TRL with num_iterations=1."""
    ref_logps: torch.Tensor | None = None
    """The reference model's log-probabilities; needed when beta > 0."""
    loss: GRPOLossSettings = GRPOLossSettings()
    """The loss's settings (finetune.grpo's)."""
    temperature: float = 1.0
    """The rollout's sampling temperature: the log-probabilities are log_softmax(logits / temperature), as TRL's."""
    vllm_importance_sampling_correction: bool = False
    """Weight each token's loss by the ratio of the trainer's (old) to the rollout's log-probabilities; off unless
    asked (finetune.grpo's default is on: from_config copies it)."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float | None = 3.0
    total_rows: int = 0
    """Rows in the whole step's batch when the ranks of a data-parallel run share it; 0: this batch's own."""
    total_tokens: int = 0
    """Completion tokens (labels != -100) in the whole step's batch when ranks share it; 0: this batch's own."""

    def __post_init__(self) -> None:
        rows = self.advantages.shape[0] if self.advantages.dim() == 1 else -1
        for name in ("sampling_logps", "old_logps", "ref_logps"):
            t = getattr(self, name)
            if rows < 0 or (t is not None and (t.dim() != 2 or t.shape[0] != rows)):
                raise ValueError(f"PolicyRows: advantages must be [rows] and {name} [rows, seq_len]; got "
                                 f"{tuple(self.advantages.shape)} and {None if t is None else tuple(t.shape)}")

    @classmethod
    def from_config(cls, grpo: Any, advantages: torch.Tensor, *, sampling_logps: torch.Tensor | None = None,
                    old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
                    total_rows: int = 0, total_tokens: int = 0) -> PolicyRows:
        """With the settings of the config's finetune.grpo section (config/grpo_section.py: GRPOConfig; read by
        name, as this module imports no config)."""
        return cls(advantages, sampling_logps, old_logps, ref_logps, loss=GRPOLossSettings.of(grpo),
                   temperature=grpo.temperature,
                   vllm_importance_sampling_correction=grpo.vllm_importance_sampling_correction,
                   vllm_importance_sampling_mode=grpo.vllm_importance_sampling_mode,
                   vllm_importance_sampling_clip_min=grpo.vllm_importance_sampling_clip_min,
                   vllm_importance_sampling_clip_max=grpo.vllm_importance_sampling_clip_max,
                   total_rows=total_rows, total_tokens=total_tokens)

    def select(self, rows: Any, total_rows: int, total_tokens: int) -> PolicyRows:
        """These rows only (an index or slice of the rows: a data-parallel rank's share), dividing by the whole
        batch's `total_rows` and `total_tokens`."""
        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[rows]
        return replace(self, advantages=self.advantages[rows], sampling_logps=pick(self.sampling_logps),
                       old_logps=pick(self.old_logps), ref_logps=pick(self.ref_logps), total_rows=total_rows,
                       total_tokens=total_tokens)


def _tensor_bytes(t: torch.Tensor) -> tuple[Any, torch.dtype, tuple[int, ...]]:
    """A CPU tensor as (its bytes as a numpy array, dtype, shape): pickled with protocol 5 the array is an
    out-of-band buffer, which Ray writes to its object store and hands the receiver without a copy (a torch tensor
    is pickled in-band: copied into the pickle, then again out of it)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy(), t.dtype, tuple(t.shape)


def _tensor_of_bytes(data: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    import warnings

    with warnings.catch_warnings():  # Ray's buffers are read-only; the tensors are only read (moved to the device)
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data).view(dtype).reshape(shape)


def _image_inputs(pixels: tuple, extra: dict[str, tuple]) -> "ImageInputs":
    return ImageInputs(_tensor_of_bytes(*pixels), {k: _tensor_of_bytes(*v) for k, v in extra.items()})


@dataclass(frozen=True, slots=True)
class ImageInputs:
    """The images of a batch of a vision-language model (model/vision/): the processor's output for them, in the
    order their placeholder tokens appear in the rows (row by row), read by the model's own get_image_features.

    The one bulk tensor in a message (8 images of 448x448 are 38.5 MB of float32 patches): pickled as numpy bytes,
    so the driver's hand-over to the GPU worker through Ray copies it once, into the object store, and the worker
    reads it there (`__reduce__`)."""

    pixel_values: torch.Tensor
    """As the model's processor returns them: [images, channels, height, width] (LLaVA, Gemma 3)."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Further inputs of get_image_features the processor gives (image_sizes, ...), by their names there."""

    @property
    def count(self) -> int:
        """The number of images: one per row of Qwen-VL's image_grid_thw (its pixel_values are the images' patches,
        one row each), else pixel_values' first dimension."""
        grid = self.extra.get("image_grid_thw")
        return int(grid.shape[0]) if grid is not None else int(self.pixel_values.shape[0])

    def __reduce__(self) -> tuple[Any, tuple]:
        return _image_inputs, (_tensor_bytes(self.pixel_values), {k: _tensor_bytes(v) for k, v in self.extra.items()})


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
    policy: PolicyRows | None = None
    """GRPO: the rows are sampled completions (the head computes the GRPO loss); None: cross-entropy."""
    images: ImageInputs | None = None
    """A vision-language model's images of these rows (their features replace the image tokens' embeddings);
    None: text only."""

    def __post_init__(self) -> None:
        if self.preference is not None and self.policy is not None:
            raise ValueError("a batch is DPO pairs (preference) or GRPO completions (policy), not both")

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor) -> Batch:
        """A [batch, seq_len + 1] window of a token stream: inputs and their shifted labels."""
        return cls(tokens[:, :-1], tokens[:, 1:])

    @property
    def loss_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())
