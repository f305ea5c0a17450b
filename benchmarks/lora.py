"""The LoRA systems of benchmarks/run.py: the same adapters (the config's finetune.lora: r, lora_alpha,
target_modules) trained by megatrain and by the usual transformers + peft setups.

- megatrain-lora (a variant, benchmarks/common.py): megatrain with finetune.method=lora, the base streamed
  in bf16 (precision.stream_dtype=auto).
- peft-resident-compile: the Hugging Face model in bf16 on the GPU, frozen, with peft's LoRA adapters (float32,
  as peft keeps them over a bf16 base), each decoder layer through torch.compile, torch fused AdamW over the
  adapters and clip_grad_norm_; activation checkpointing only when the run with every activation kept does not
  fit (tried first; the row's `checkpointing` says which).
- peft-deepspeed: the same peft model under DeepSpeed ZeRO-3 with the base's parameters offloaded to pinned
  CPU memory (the adapters' optimizer stays on the GPU: it is small), bf16, activation checkpointing.

The model, batch and steps are the harness's; each builder returns the `train_step(ids) -> loss` that
benchmarks/run.py times.
"""

from __future__ import annotations

from typing import Any


def peft_lora_config(cfg: Any):
    """peft.LoraConfig of the run's finetune.lora settings (target_modules by name, as peft matches them)."""
    import peft

    lora = cfg.finetune.lora
    return peft.LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout, bias=lora.bias,
                           target_modules=list(lora.targets(cfg.model.family)), use_rslora=lora.use_rslora,
                           modules_to_save=list(lora.modules_to_save) or None, task_type="CAUSAL_LM")


def peft_resident_model(cfg: Any, compile_layers: bool, checkpointing: bool, device: str = "cuda"):
    """(model, optimizer, train_step) of the GPU-resident peft baseline: the base in bf16 (random weights of the
    config's shape: the speed does not depend on them), frozen; the adapters in float32."""
    import peft
    import torch

    from benchmarks.run import _hf_model

    cls, hf = _hf_model(cfg)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        model = cls(hf)
    torch.set_default_dtype(torch.float32)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()  # checkpointed layers need an input that requires grad (peft's advice)
    model = peft.get_peft_model(model, peft_lora_config(cfg))
    if compile_layers:
        for layer in model.get_base_model().model.layers:
            layer.compile()
    o = cfg.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                            fused=device == "cuda")

    def train_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, opt, train_step


def run_peft_resident_compile(spec: dict) -> dict:
    import torch

    from benchmarks.run import _load, _timed_steps

    cfg = _load(spec)
    for checkpointing in (False, True):
        model = opt = train_step = None
        try:
            model, opt, train_step = peft_resident_model(cfg, compile_layers=True, checkpointing=checkpointing)
            row = _timed_steps(spec, cfg, train_step)
            break
        except torch.OutOfMemoryError:
            if checkpointing:
                raise
            del model, opt, train_step
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    row.update(precision="bf16 frozen base, fp32 LoRA adapters and AdamW states on the GPU", compiled=True,
               checkpointing=checkpointing, lora_r=cfg.finetune.lora.r)
    return row


def deepspeed_lora_config(cfg: Any, batch: int) -> dict:
    """DeepSpeed's config for the peft baseline: ZeRO-3, the parameters offloaded to pinned CPU memory (the
    frozen base is nearly all of them), the optimizer (the adapters' AdamW) on the GPU, bf16, the run's clipping."""
    o = cfg.optimizer
    return {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                  "weight_decay": o.weight_decay}},
        "steps_per_print": 10**9,
    }


def run_peft_deepspeed(spec: dict) -> dict:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import peft

    from benchmarks.run import _hf_model, _load, _timed_steps
    from megatrain_ray.observe.metrics import proc_status_bytes

    cfg = _load(spec)
    ds_config = deepspeed_lora_config(cfg, spec["batch"])
    deepspeed.init_distributed(dist_backend="nccl")
    cls, hf = _hf_model(cfg)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = cls(hf)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model.config.use_cache = False
    model = peft.get_peft_model(model, peft_lora_config(cfg))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)

    def train_step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    row = _timed_steps(spec, cfg, train_step)
    row.update(host_bytes_per_param=proc_status_bytes("VmRSS") / row["params"], lora_r=cfg.finetune.lora.r,
               precision="bf16 base offloaded to CPU (ZeRO-3), LoRA adapters and AdamW on the GPU")
    return row


LORA_SYSTEMS = {"peft-resident-compile": run_peft_resident_compile, "peft-deepspeed": run_peft_deepspeed}
"""benchmarks/run.py's LoRA baselines (megatrain's own LoRA row is the megatrain-lora variant)."""
