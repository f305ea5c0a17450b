"""The `finetune` section: what training changes (every weight, or LoRA adapters on a frozen base, in bf16 or
NF4) and what it optimizes (cross-entropy, DPO, or GRPO: config/grpo_section.py). Their checks against the other
sections are with Config (config/sections.py: check_finetune, check_objective)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatrain_ray.config.fields import refuse as _fail
from megatrain_ray.config.grpo_section import GRPOConfig
from megatrain_ray.config.lora_targets import (  # noqa: F401
    LORA_PROJECTIONS,
    PHI3_LORA_PROJECTIONS,
    lora_targets,
    refuse_param_adapter_settings,
)


@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """LoRA adapters, with PEFT's names and meanings (peft.LoraConfig)."""

    SECTION: ClassVar[str] = "finetune.lora"
    r: int = 8
    """Rank of each adapter: A is [r, in_features], B is [out_features, r]."""
    lora_alpha: float = 16
    """The adapter's output is scaled by lora_alpha / r (lora_alpha / sqrt(r) with use_rslora)."""
    lora_dropout: float = 0.0
    """Dropout probability on the adapter's input in training (as PEFT's). The masks are drawn from a seed per
    step and layer, so the backward's recompute sees the forward's; with dropout the layers run eagerly
    (engine.compile does not apply)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """The projections that get adapters: `all-linear` (every linear module of the decoder layers, not the LM head,
    as PEFT's all-linear), or a list of PEFT short names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj). Mixture-of-experts families, as peft 0.21:
    gpt_oss q_proj, k_proj, v_proj, o_proj (all-linear is those four); qwen3_moe and mixtral also `gate` (the
    router), gate_proj + up_proj (Mixtral w1 + w3: the fused experts' gate_up_proj, one adapter per expert) and
    down_proj (w2), all of which all-linear includes; deepseek_v3 and glm4_moe as qwen3_moe, deepseek_v3's attention
    projections being its latent attention's (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj),
    their shared experts and dense first layers' MLPs never adapted, as in peft. Hybrids: the attention projections
    and the Gated DeltaNet's (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; qwen3_next in_proj_qkvz,
    in_proj_ba, out_proj); qwen3_5 also its MLP's, qwen3_5_moe its shared expert's gate_proj, up_proj, down_proj and
    shared_expert_gate; qwen3_next shared_expert_gate and, as qwen3_moe, `gate`, gate_proj + up_proj, down_proj (the
    router and the routed experts: its shared expert's projections and dense layers' MLPs are never adapted, as in
    peft); all-linear is all of them (docs/fine-tuning.md)."""
    bias: Literal["none"] = "none"
    """PEFT's bias setting; only `none` (biases stay frozen)."""
    use_rslora: bool = False
    """Rank-stabilised LoRA: scale by lora_alpha / sqrt(r) instead of lora_alpha / r."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full beside the adapters (PEFT's modules_to_save): `embed_tokens`, `lm_head` (an untied
    LM head only). Each lives on the device in float32 with its gradient and AdamW moments (16 bytes per parameter)
    and starts as the base's."""
    base_quantization: Literal["none", "nf4"] = "none"
    """How the host stores the frozen base's decoder layers. none: in precision.stream_dtype. nf4: QLoRA's 4-bit
    base (bitsandbytes' load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, blocksize
    64): every matrix of the decoder layers is quantized once on the host when the run starts (from its values in
    precision.stream_dtype), streamed in 4 bits (about 0.52 B per parameter) and dequantized on the device into
    precision.compute_dtype as each layer arrives; norms, the embedding and the LM head stay unquantized
    (docs/fine-tuning.md, QLoRA). finetune.method=lora only."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if self.r < 1:
            _fail(f"{s}.r", self.r, "must be >= 1")
        if not self.lora_alpha > 0:
            _fail(f"{s}.lora_alpha", self.lora_alpha, "must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            _fail(f"{s}.lora_dropout", self.lora_dropout, "must be in [0, 1)")
        if isinstance(self.target_modules, list) and not self.target_modules:
            _fail(f"{s}.target_modules", self.target_modules, "is empty; name projections or use all-linear")
        unknown = [name for name in self.modules_to_save if name not in ("embed_tokens", "lm_head")]
        if unknown or len(set(self.modules_to_save)) != len(self.modules_to_save):
            _fail(f"{s}.modules_to_save", self.modules_to_save, "may name embed_tokens and lm_head, each once")

    @property
    def scaling(self) -> float:
        """The factor on the adapter's output, as PEFT computes it."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def targets(self, family: str) -> tuple[str, ...]:
        """The targeted projections' short names for a model family, in the layer's order (config/lora_targets.py:
        on the mixture-of-experts families, the router and experts as `gate`, `gate_up_proj`, `down_proj`)."""
        targets = lora_targets(family, self.target_modules, f"{self.SECTION}.target_modules")
        refuse_param_adapter_settings(family, targets, self.use_rslora, self.lora_dropout, self.SECTION)
        return targets


@dataclass(kw_only=True, slots=True)
class DPOConfig:
    """Direct preference optimization (finetune.objective=dpo; docs/fine-tuning.md, megatrain_ray/model/preference.py)."""

    SECTION: ClassVar[str] = "finetune.dpo"
    beta: float = 0.1
    """How far the model may move from the reference (the initial model): the DPO loss is a function of
    beta * ((logp_chosen - logp_rejected) - (ref_chosen - ref_rejected)), log-probabilities summed over
    the completion tokens, as TRL's DPOTrainer."""
    label_smoothing: float = 0.0
    """The probability that a preference label is flipped. sigmoid: -(1 - e) logsigmoid(beta z) - e logsigmoid(-beta z)
    (conservative DPO; TRL 1.16's sigmoid has no label smoothing, so it equals it at 0 only); robust: TRL's robust DPO."""
    loss_type: Literal["sigmoid", "robust"] = "sigmoid"
    """sigmoid: DPO (with label_smoothing, conservative DPO); robust: robust DPO (unbiased under flipped labels)."""

    def __post_init__(self) -> None:
        s = self.SECTION
        if not self.beta > 0:
            _fail(f"{s}.beta", self.beta, "must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            _fail(f"{s}.label_smoothing", self.label_smoothing, "must be in [0, 0.5)")


@dataclass(kw_only=True, slots=True)
class FinetuneConfig:
    """What training changes (every weight, or low-rank adapters on a frozen base) and what it optimizes
    (cross-entropy, a preference loss, or a policy-gradient loss)."""

    SECTION: ClassVar[str] = "finetune"
    method: Literal["full", "lora"] = "full"
    """full: every weight trains (fp32 master and AdamW moments in host RAM, the CPU optimizer workers). lora: the
    base is frozen and streamed from host RAM in precision.stream_dtype only, or in NF4 (finetune.lora.base_quantization;
    no master, moments or gradient buffers); the adapters, their gradients and their AdamW state live on the compute
    device (with several GPUs of one node, on each: their gradients are summed in one all-reduce)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """The adapters' settings (method lora)."""
    objective: Literal["sft", "dpo", "grpo"] = "sft"
    """sft: cross-entropy on the loss-mask tokens (pre-training, supervised fine-tuning). dpo: direct preference
    optimization on preference pairs from `megatrain prepare --format preference`; the reference log-probabilities
    come from one forward pass of the initial model before the first step (see finetune.dpo). grpo: group relative
    policy optimization with reward functions on prompts from `megatrain prepare --format prompts`; each step's
    completions are sampled by the built-in rollout engine in the GPU worker (see finetune.grpo)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """The DPO loss's settings (finetune.objective=dpo; read only then)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO's settings and reward functions (finetune.objective=grpo; read only then)."""
    vision: Literal["frozen", "lora", "full"] = "frozen"
    """A vision-language model's vision tower (model.path a LLaVA or Gemma 3 multimodal checkpoint; read only then):
    frozen: the tower is frozen and the multimodal projector trains (as LLaMA-Factory's default); full: tower and
    projector train. Either way their weights, gradients and AdamW state live on the compute device in the master
    dtype, are checkpointed with the run (vision.safetensors) and exported with the model (docs/vision.md). lora
    (adapters on the tower) is not implemented yet: refused when the run starts."""
