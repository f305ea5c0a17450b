"""The LoRA baselines of benchmarks/run.py: what users run today for LoRA on one GPU.

- peft-resident: the Hugging Face model on the GPU in bf16 with peft's LoRA adapters (fp32, as peft casts
  them on a bf16 base), activation checkpointing per layer, torch fused AdamW over the adapters and
  clip_grad_norm_ over them; layers eager.
- peft-resident-compile: the same with each decoder layer through torch.compile, and activation
  checkpointing only when the model with every activation kept does not fit (the row's `checkpointing`
  says which): the GPU-resident LoRA run a user would pick.
- peft-deepspeed: the same peft model under DeepSpeed ZeRO-3 with the parameters (the frozen bf16 base)
  and the optimizer offloaded to pinned CPU memory, activation checkpointing.

The adapters' settings are the config's finetune.lora (r, lora_alpha, lora_dropout, target_modules,
use_rslora), the same that megatrain's `finetune.method=lora` rows use.
"""

from __future__ import annotations

import os


def lora_settings(cfg):
    """peft's LoraConfig from the run's finetune.lora (the family decides what all-linear covers, as in megatrain)."""
    from peft import LoraConfig

    lora = cfg.finetune.lora
    return LoraConfig(r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                      target_modules=list(lora.targets(cfg.model.family)), use_rslora=lora.use_rslora,
                      bias="none", task_type="CAUSAL_LM")


def _with_adapters(model, cfg, checkpointing: bool):
    from peft import get_peft_model

    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()  # the frozen embedding's output must carry grad into each segment
    return get_peft_model(model, lora_settings(cfg))


def _adapter_step(model, parameters, cfg, optimizer_step):
    """train_step(ids) -> loss: forward, backward, clip over the adapters, optimizer_step()."""
    import torch

    def train_step(ids):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if cfg.optimizer.grad_clip > 0:  # 0 is "off" in the config; clip_grad_norm_ would zero every gradient
            torch.nn.utils.clip_grad_norm_(parameters, cfg.optimizer.grad_clip)
        optimizer_step()
        return loss

    return train_step


def _resident_peft(cfg, hf_model, compile_layers: bool, checkpointing: bool):
    import torch

    cls, hf = hf_model(cfg)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        base = cls(hf)
    torch.set_default_dtype(torch.float32)
    model = _with_adapters(base, cfg, checkpointing)
    if compile_layers:
        for layer in model.base_model.model.model.layers:
            layer.compile()
    trainable = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW(trainable, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                            fused=True)

    def optimizer_step():
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, _adapter_step(model, trainable, cfg, optimizer_step)


def _adapter_counts(model) -> dict:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"adapter_params": trainable, "finetune": "lora"}


def run_peft_resident(spec: dict, load, hf_model, timed_steps) -> dict:
    cfg = load(spec)
    model, _, train_step = _resident_peft(cfg, hf_model, compile_layers=False, checkpointing=True)
    row = timed_steps(spec, cfg, train_step)
    row.update(precision="bf16 base, fp32 adapters (peft), torch fused AdamW on the GPU", compiled=False,
               checkpointing=True, **_adapter_counts(model))
    return row


def run_peft_resident_compile(spec: dict, load, hf_model, timed_steps) -> dict:
    import torch

    cfg = load(spec)
    for checkpointing in (False, True):
        model = opt = train_step = None
        try:
            model, opt, train_step = _resident_peft(cfg, hf_model, compile_layers=True, checkpointing=checkpointing)
            row = timed_steps(spec, cfg, train_step)
            break
        except torch.OutOfMemoryError:
            if checkpointing:
                raise
            del model, opt, train_step
            torch._dynamo.reset()
            torch.cuda.empty_cache()
    row.update(precision="bf16 base, fp32 adapters (peft), torch fused AdamW on the GPU", compiled=True,
               checkpointing=checkpointing, **_adapter_counts(model))
    return row


def run_peft_deepspeed(spec: dict, load, hf_model, timed_steps) -> dict:
    from megatrain_ray.observe.metrics import proc_status_bytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed

    cfg = load(spec)
    o = cfg.optimizer
    ds_config = {
        "train_micro_batch_size_per_gpu": spec["batch"], "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True}, "gradient_clipping": o.grad_clip,
        "zero_optimization": {
            "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": o.lr, "betas": [o.beta1, o.beta2], "eps": o.eps,
                                                  "weight_decay": o.weight_decay}},
        "steps_per_print": 10**9,
    }
    deepspeed.init_distributed(dist_backend="nccl")
    cls, hf = hf_model(cfg)
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = _with_adapters(cls(hf), cfg, checkpointing=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config)

    def train_step(ids):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss

    row = timed_steps(spec, cfg, train_step)
    row["host_bytes_per_param"] = proc_status_bytes("VmRSS") / row["params"]  # DeepSpeed's host state is in-process
    row.update(precision="bf16 base offloaded, adapters under ZeRO-3 (DeepSpeedCPUAdam)", checkpointing=True,
               adapter_params=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in trainable),
               finetune="lora")
    return row


def h2d_probe_gbps(gib: float = 2.0, repeats: int = 3) -> float:
    """Pinned host -> device copy bandwidth of one large copy (the best of a few), GB/s: the H2D bound of a
    LoRA step, whose only traffic is the frozen base streamed in."""
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
