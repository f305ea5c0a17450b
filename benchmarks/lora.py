"""The LoRA systems of benchmarks/run.py: the same adapters (the config's finetune.lora: r, lora_alpha,
target_modules) trained by megatrain and by the usual transformers + peft setups.

- megatrain-lora (a variant, benchmarks/common.py): megatrain with finetune.method=lora, the base streamed
  in bf16 (precision.stream_dtype=auto); megatrain-lora-resident: the same with engine.gpu_resident=auto, the
  base's layers that fit the GPU kept there (all of a 32B base on an H200 at 8k tokens; the row's
  resident_layers says how many).
- peft-resident-compile: the Hugging Face model in bf16 on the GPU, frozen, with peft's LoRA adapters (float32,
  as peft keeps them over a bf16 base), each decoder layer through torch.compile, torch fused AdamW over the
  adapters and clip_grad_norm_; activation checkpointing only when the run with every activation kept does not
  fit (tried first; the row's `checkpointing` says which).
- peft-resident: the same, layers eager, activation checkpointing.
- peft-deepspeed: the same peft model under DeepSpeed ZeRO-3 with the base's parameters and the (adapters')
  optimizer offloaded to pinned CPU memory, as the usual ZeRO-3 offload config does, bf16, activation
  checkpointing.

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


def _lora_row(row: dict, cfg: Any, model, **extra) -> dict:
    adapters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    row.update(finetune="lora", lora_r=cfg.finetune.lora.r, adapter_params=adapters, **extra)
    return row


def run_peft_resident(spec: dict) -> dict:
    from benchmarks.run import _load, _timed_steps

    cfg = _load(spec)
    model, _, train_step = peft_resident_model(cfg, compile_layers=False, checkpointing=True,
                                               device=spec.get("device", "cuda"))
    return _lora_row(_timed_steps(spec, cfg, train_step), cfg, model, compiled=False, checkpointing=True,
                     precision="bf16 frozen base, fp32 LoRA adapters and AdamW states on the GPU")


def run_peft_resident_compile(spec: dict) -> dict:
    from benchmarks.common import compiled_resident_run
    from benchmarks.run import _load, _timed_steps

    cfg = _load(spec)

    def build(checkpointing: bool):
        model, _, train_step = peft_resident_model(cfg, compile_layers=True, checkpointing=checkpointing,
                                                   device=spec.get("device", "cuda"))
        return model, train_step

    row, checkpointing, model = compiled_resident_run(build, lambda step: _timed_steps(spec, cfg, step))
    return _lora_row(row, cfg, model, compiled=True, checkpointing=checkpointing,
                     precision="bf16 frozen base, fp32 LoRA adapters and AdamW states on the GPU")


def deepspeed_lora_config(cfg: Any, batch: int) -> dict:
    """DeepSpeed's config for the peft baseline: ZeRO-3, the parameters (the frozen base is nearly all of them) and
    the optimizer (the adapters' AdamW, DeepSpeedCPUAdam) offloaded to pinned CPU memory, bf16, the run's clipping."""
    o = cfg.optimizer
    return {
        "train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": o.grad_clip,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True},
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

    from benchmarks.common import deepspeed_train_step
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

    row = _timed_steps(spec, cfg, deepspeed_train_step(engine))
    return _lora_row(row, cfg, model, host_bytes_per_param=proc_status_bytes("VmRSS") / row["params"],
                     precision="bf16 base and the adapters' AdamW offloaded to CPU (ZeRO-3)")


def h2d_probe_gbps(gib: float = 2.0, repeats: int = 3) -> float:
    """Pinned host -> device copy bandwidth of one large copy (the best of a few), GB/s: the H2D bound of a
    LoRA step, whose only host traffic is the frozen base streamed in."""
    import time

    import torch

    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return n / best / 1e9


LORA_SYSTEMS = {"peft-resident": run_peft_resident, "peft-resident-compile": run_peft_resident_compile,
               "peft-deepspeed": run_peft_deepspeed}
"""benchmarks/run.py's LoRA baselines (megatrain's own LoRA row is the megatrain-lora variant)."""
