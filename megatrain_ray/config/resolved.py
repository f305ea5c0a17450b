"""RunSpec: every setting of a run that follows from several config sections and the machine.

The driver resolves one spec, once, from the config and what it learned of the machine (device
kind, GPUs per node, whether the kept layer inputs fit the GPU), and sends it to every actor. The
components read their own config section plus the spec; nothing re-derives these settings, so the
planner, the host store, the engine and the optimizer workers cannot disagree about them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatrain_ray.config.sections import Config
from megatrain_ray.dtypes import DTYPE_BYTES
from megatrain_ray.exceptions import ConfigError

GradHome = Literal["stream", "stage", "pool"]
"""Where a stage's gradients land on the host: in its streaming copy (free until its update), in a
buffer of its own (clipping on: every stage's gradients wait for the global norm), or in a small pool
of slabs reused as updates finish (clipping off). See store/segments.py."""


RESIDENT_UPDATE_CHUNK_ELEMS = 1 << 24
"""Elements per chunk of a resident stage's update on the device (engine/resident.py): its scratch, the
gradient in the master dtype, stays this size (64 MiB in fp32) instead of a whole stage's."""


def takes_compiled_layer(tokens: int, mlp_chunk_tokens: int, packed: bool) -> bool:
    """Whether a step of `tokens` tokens (per GPU) can take the compiled layer template: packed documents
    (their per-document attention) and a chunked MLP (its loop over slices) run the eager one."""
    return not packed and (mlp_chunk_tokens <= 0 or tokens <= mlp_chunk_tokens)


@dataclass(frozen=True, slots=True)
class RunSpec:
    device_type: Literal["cuda", "cpu"]
    """Where the layer stream computes."""
    ranks_per_node: int
    """GPU workers sharing one node's host store (parallel.gpus / parallel.nodes)."""
    nodes: int
    rank_tokens: int
    """Tokens one GPU computes per step: its rows of the global batch."""
    master_dtype: str
    compute_dtype: str
    stream_dtype: str
    """The host copy streamed to the device (precision.stream_dtype with auto resolved)."""
    stream_is_master: bool
    """The master weights are streamed directly (no separate streaming copy)."""
    grad_home: GradHome
    grad_dtype: str
    """Format of the gradients on the host: the streaming copy's when they land in it, else precision.grad_dtype."""
    moment_dtype: str
    """Format of the AdamW moments: the master's at full precision, else bfloat16."""
    vocab_in_pieces: bool
    """Whether, in the slab pool, a stage larger than a layer (embedding, LM head) goes through the
    layer-sized slabs in pieces, each copied and updated on its own (engine.vocab_grad_pieces). Only with
    one GPU worker per node and the moments in RAM: other ranks' pieces would need landing counters of
    their own, and the disk tier stages whole stage spans."""
    compiles: bool
    """The decoder-layer template goes through torch.compile on this device (engine.compile)."""
    device_compiles: bool
    """engine.compile is on for this device: the loss head's chunks (model/head.chunk_cross_entropy) and an NF4
    base's dequantization (quant/nf4_stage.decode_blocks) go through torch.compile, whatever the layers do."""
    layers_compiled: bool
    """And this run's training rows take it (see takes_compiled_layer)."""
    activation_offload: bool
    """Kept layer inputs live in pinned host memory (engine.activation_offload with auto decided by the plan)."""
    resident_layers: int = 0
    """Decoder layers kept whole on the compute device (engine.gpu_resident; model.layout.resident_stages
    says which). With a frozen base (LoRA) only their base weights, which the host store keeps too."""
    resident_vocab: bool = False
    """The embedding and the LM head are GPU-resident too (engine.gpu_resident all, or auto where they fit): their
    state and update on the device as the resident layers'."""
    kept_layers: int = 0
    """Of the resident layers, the last this many keep their forward's autograd graph for the backward (no
    recompute; engine.kept_activations; model.layout.kept_stages says which)."""
    frozen_base: bool = False
    """finetune.method=lora: the host holds the base once, in the streaming dtype (as its `master`, streamed
    directly); no moments, gradients or optimizer workers. The adapters train on the device (engine/adapters.py).
    A forward-only session (driver/session.py, `megatrain generate`) holds a whole model so, with no adapters."""
    speculative_stages: int = 0
    """Stages updated before the step's gradient norm is known (optimizer.speculative_stages; model.layout's
    speculative_stages says which), each with a second set of state in the host store."""
    optimizer_state: Literal["full", "lean"] = "full"
    """optimizer.state: lean keeps a bfloat16 master (kind `master`, streamed directly) with its compensation
    (`master_comp`) and lean moments (moment_dtype uint8: 8-bit codes with `*_scale` blocks; or bfloat16)."""
    lean_block: int = 0
    """Elements per quantization block of 8-bit lean moments (optimizer.lean_block); 0 for any other state: the
    optimizer workers' spans start on multiples of it (optim/lean_adamw.span_align)."""
    base_quantization: Literal["none", "nf4"] = "none"
    """finetune.lora.base_quantization of a frozen base: nf4 holds its decoder layers packed in NF4 (kind `nf4`,
    store/nf4_base.py), dequantized on the device into the compute dtype."""
    reference_copy: bool = False
    """GRPO with finetune.grpo.beta > 0, full fine-tuning: the host keeps a frozen copy of the initial weights in the
    streaming dtype (kind `reference`), which the reference pass streams instead of the trained ones. A LoRA run's
    reference is its base with the adapters left out: no copy."""

    @property
    def world(self) -> int:
        return self.ranks_per_node * self.nodes

    def checkpoint_bytes(self, num_params: int, adapter_params: int = 0) -> int:
        """A checkpoint's size: the master weights and both AdamW moments (LoRA: the float32 adapters' and their
        moments only; `adapter_params`: model/lora.adapter_numel); lean: with the compensation and the scales."""
        if self.frozen_base:
            return 3 * 4 * adapter_params
        if self.optimizer_state == "lean":
            scales = 2 * 4 * num_params // self.lean_block if self.lean_block else 0
            return num_params * (2 * DTYPE_BYTES[self.master_dtype] + 2 * DTYPE_BYTES[self.moment_dtype]) + scales
        return num_params * (DTYPE_BYTES[self.master_dtype] + 2 * DTYPE_BYTES[self.moment_dtype])

    def resident_stage_bytes(self, numel: int) -> int:
        """Device bytes of one GPU-resident stage of `numel` elements (engine/resident.py): master and both
        moments, the gradient buffer, and the compute copy unless the master is computed on directly."""
        per_element = 3 * DTYPE_BYTES[self.master_dtype] + DTYPE_BYTES[self.grad_dtype]
        if self.compute_dtype != self.master_dtype:
            per_element += DTYPE_BYTES[self.compute_dtype]
        return numel * per_element

    def resident_scratch_bytes(self, largest_numel: int) -> int:
        """The tier's one update scratch buffer (none without resident stages)."""
        return min(largest_numel, RESIDENT_UPDATE_CHUNK_ELEMS) * DTYPE_BYTES[self.master_dtype]

    def runs_compiled(self, tokens: int, mlp_chunk_tokens: int, packed: bool) -> bool:
        """Whether a call of the layer over `tokens` tokens takes the compiled template (evaluation batches
        may differ in shape from training ones)."""
        return self.compiles and takes_compiled_layer(tokens, mlp_chunk_tokens, packed)

    @classmethod
    def resolve(cls, cfg: Config, *, device_type: str = "cuda", ranks_per_node: int | None = None,
                nodes: int | None = None) -> "RunSpec":
        """The spec of `cfg` on a machine with `device_type`. `ranks_per_node`: GPUs per node once
        `parallel.gpus: auto` is known (default: the config's count, auto planned as 1). engine.activation_offload
        auto reads as off here: planning.gpu_memory.resolve_run decides it from the GPU's memory."""
        p, e, o = cfg.precision, cfg.engine, cfg.optimizer
        ranks = ranks_per_node if ranks_per_node is not None else \
            (cfg.parallel.gpus // cfg.parallel.nodes if cfg.parallel.gpus != "auto" else 1)
        nodes = nodes if nodes is not None else cfg.parallel.nodes
        device: Literal["cuda", "cpu"] = "cuda" if device_type == "cuda" else "cpu"
        stream_dtype, stream_is_master = p.resolved_stream_dtype, p.stream_is_master
        grad_home: GradHome = "stream" if not stream_is_master else ("stage" if o.grad_clip > 0 else "pool")
        rank_tokens = cfg.data.batch_size // (ranks * nodes) * cfg.data.seq_len
        # The generic path runs transformers' own layer class eagerly (model.template); MoE layers compile where
        # their expert groups do not change the shapes (ModelConfig.layers_compile).
        device_compiles = e.compile is True or (e.compile == "auto" and device == "cuda")
        compiles = device_compiles and cfg.model.template != "generic" and cfg.model.layers_compile(p.compute_dtype)
        if cfg.finetune.method == "lora":
            compiles = compiles and not cfg.finetune.lora.lora_dropout  # the masks' generators run eagerly
            if nodes > 1:
                raise ConfigError("finetune.method=lora needs one node: set parallel.nodes=1")
            return cls(
                device_type=device, ranks_per_node=ranks, nodes=nodes, rank_tokens=rank_tokens,
                master_dtype=stream_dtype, compute_dtype=p.compute_dtype, stream_dtype=stream_dtype,
                stream_is_master=True, grad_home="stream", grad_dtype=stream_dtype, moment_dtype=stream_dtype,
                vocab_in_pieces=False, compiles=compiles, device_compiles=device_compiles,
                layers_compiled=compiles and takes_compiled_layer(rank_tokens, e.mlp_chunk_tokens, cfg.data.packing),
                activation_offload=e.activation_offload is True, resident_layers=resident_layer_count(cfg, ranks),
                frozen_base=True,
                base_quantization=cfg.finetune.lora.base_quantization)
        reference = cfg.finetune.objective == "grpo" and cfg.finetune.grpo.beta > 0  # GRPO's KL: the initial weights
        if o.state == "lean":  # config/sections.check_lean refused what it cannot take
            int8 = o.lean_moments == "int8"
            grad_home = "stage" if o.grad_clip > 0 else "pool"  # the master is streamed: gradients land apart
            return cls(
                device_type=device, ranks_per_node=ranks, nodes=nodes, rank_tokens=rank_tokens,
                master_dtype="bfloat16", compute_dtype=p.compute_dtype, stream_dtype="bfloat16",
                stream_is_master=True, grad_home=grad_home, grad_dtype=p.resolved_grad_dtype,
                moment_dtype="uint8" if int8 else "bfloat16",
                # Vocabulary pieces cut stages at multiples of a layer's size, not of a quantization block.
                vocab_in_pieces=(e.vocab_grad_pieces and grad_home == "pool" and ranks == 1 and not int8),
                compiles=compiles, device_compiles=device_compiles,
                layers_compiled=compiles and takes_compiled_layer(rank_tokens, e.mlp_chunk_tokens, cfg.data.packing),
                activation_offload=e.activation_offload is True, resident_layers=0,
                optimizer_state="lean", lean_block=o.lean_block if int8 else 0, reference_copy=reference)
        return cls(
            device_type=device, ranks_per_node=ranks, nodes=nodes, rank_tokens=rank_tokens,
            master_dtype=p.master_dtype, compute_dtype=p.compute_dtype, stream_dtype=stream_dtype,
            stream_is_master=stream_is_master, grad_home=grad_home,
            grad_dtype=stream_dtype if grad_home == "stream" else p.resolved_grad_dtype,
            moment_dtype="bfloat16" if o.moment_dtype == "bfloat16" else p.master_dtype,
            vocab_in_pieces=(e.vocab_grad_pieces and grad_home == "pool" and ranks == 1
                             and cfg.host.moments_tier == "ram"),
            compiles=compiles, device_compiles=device_compiles,
            layers_compiled=compiles and takes_compiled_layer(rank_tokens, e.mlp_chunk_tokens, cfg.data.packing),
            activation_offload=e.activation_offload is True,
            resident_layers=(resident := resident_layer_count(cfg, ranks * nodes)),
            resident_vocab=resident_vocab(cfg), kept_layers=kept_layer_count(cfg, resident),
            speculative_stages=o.speculative_stages,
            reference_copy=reference)


def resident_layer_count(cfg: Config, world: int) -> int:
    """engine.gpu_resident as a number of layers, refused where the tier does not apply (yet). auto reads as
    none here: planning.gpu_memory.resolve_run decides it from the GPU's memory."""
    choice = cfg.engine.gpu_resident
    count = 0 if choice in ("none", "auto") else cfg.model.num_layers if choice == "all" else int(choice)
    if count == 0:
        return 0
    if count > cfg.model.num_layers:
        raise ConfigError(f"engine.gpu_resident={count}: the model has {cfg.model.num_layers} layers")
    why = resident_tier_refusal(cfg, world)
    if why:
        raise ConfigError(f"engine.gpu_resident={count} needs {why}")
    return count


def resident_vocab(cfg: Config) -> bool:
    """engine.gpu_resident=all: the embedding and the LM head resident too (auto: the plan decides); refused for
    GRPO, whose rollout streams them (engine/rollout/)."""
    if cfg.engine.gpu_resident != "all":
        return False
    if cfg.finetune.objective == "grpo":
        raise ConfigError("engine.gpu_resident=all keeps the embedding and LM head on the device, which GRPO's rollout "
                          "streams: set engine.gpu_resident=auto or a number of layers")
    return True


def kept_layer_count(cfg: Config, resident_layers: int) -> int:
    """engine.kept_activations as a number of layers: at most the resident layers; auto reads as none here
    (planning.gpu_memory.resolve_run decides it); none for model.template generic (its layers recompute)."""
    kept = cfg.engine.kept_activations
    if kept == "auto" or cfg.model.template == "generic":
        return 0
    return min(int(kept), resident_layers)


def resident_tier_refusal(cfg: Config, world: int) -> str:
    """What the GPU-resident tier needs and this config lacks ("" when it applies). A LoRA run keeps only the
    frozen base's weights there (engine/resident_base.py, packed for an NF4 base), on each of its GPU workers."""
    if cfg.finetune.method == "lora":
        return ""
    for refused, why in ((world > 1, "one GPU worker (parallel.gpus=1)"),
                         (cfg.host.moments_tier != "ram", "host.moments_tier=ram"),
                         (cfg.optimizer.moment_dtype != "float32", "optimizer.moment_dtype=float32"),
                         (cfg.optimizer.state != "full", "optimizer.state=full"),
                         (cfg.finetune.objective == "grpo" and cfg.finetune.grpo.beta > 0,
                          "finetune.grpo.beta=0 (the KL reference pass streams every layer's initial weights from "
                          "host RAM; no layer may live on the device)"),
                         (cfg.rl.separate,
                          "rl.rollout=colocated (a separate rollout worker reads every stage's new weights from the "
                          "host's streaming copy, which a GPU-resident layer does not have)")):
        if refused:
            return why
    return ""
