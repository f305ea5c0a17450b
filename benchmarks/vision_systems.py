"""The systems of benchmarks/vision_bench.py, each run in a child process of its own: the model directory's build,
megatrain (tier and streamed), transformers resident with compiled decoder layers, DeepSpeed ZeRO-3 offload. Every
row a process finishes is printed (benchmarks/run.py's RESULT_TAG line) as it finishes."""

from __future__ import annotations

import json
import os
import time
import traceback

from benchmarks.common import compiled_resident_run, zero3_offload_config
from benchmarks.run import RESULT_TAG
from benchmarks.vision_shape import batches_of, random_model, vl_config

MEGATRAIN_SYSTEMS = {"megatrain": ["engine.gpu_resident=auto"], "megatrain-streamed": ["engine.gpu_resident=none"]}
BASELINES = ("resident-compile", "resident-compile-ckpt", "resident-compile-segments", "deepspeed")



def build_model_dir(spec: dict) -> dict:
    """The random-init model saved with save_pretrained (bf16) where megatrain reads it (model.path)."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = random_model(vl_config(spec["layers"], spec["tiny"]), device)
    model.save_pretrained(spec["model_dir"])
    n = sum(p.numel() for p in model.parameters())
    visual = sum(p.numel() for p in model.model.visual.parameters())
    return {"params_total": n, "params_vision": visual, "params_text": n - visual}


def run_megatrain_vision(spec: dict) -> dict:
    """benchmarks/run.py's megatrain row (its timing, memory and optimizer figures), the Trainer's batches these
    images: run_megatrain builds its Trainer by name from megatrain_ray.driver.trainer, which this child process
    points at a subclass that swaps the data in."""
    import megatrain_ray.driver.trainer as trainer_module
    from benchmarks.run import run_megatrain

    batches = batches_of(spec, spec["tokens"])
    base = trainer_module.Trainer

    class ImageTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.data = self.saver.data = batches

    trainer_module.Trainer = ImageTrainer
    try:
        row = run_megatrain({**spec, "batch": batches.rows})
    finally:
        trainer_module.Trainer = base
    row.update(tokens_per_step=spec["tokens"], image_tokens_per_step=batches.rows * batches.images * batches.image_tokens)
    return row


def timed_vision_steps(spec: dict, tokens: int, train_step) -> dict:
    """Warmup + measured steps of a baseline's `train_step(inputs) -> loss` on the same batches as megatrain's
    (moved to the device before the clock starts, as benchmarks/run.py's baselines). params and tflops as
    megatrain's rows count them (benchmarks/run.py _common: the language model's matrix products)."""
    import torch

    from benchmarks.run import _common
    from megatrain_ray.config.load import load_config

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    batches = batches_of(spec, tokens)
    image = batches.config.image_token_id
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(spec["warmup"] + spec["steps"]):
        ids, _, pixels, grids = batches.parts(step)
        inputs = {"input_ids": ids.to(device), "labels": ids.masked_fill(ids == image, -100).to(device),
                  "pixel_values": pixels.to(device, torch.bfloat16), "image_grid_thw": grids.to(device),
                  "mm_token_type_ids": (ids == image).to(torch.int32).to(device)}
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses.append(train_step(inputs).item())
        times.append(time.perf_counter() - t0)
    wall = sum(times[spec["warmup"]:])
    row = _common(load_config(spec["config"]), tokens * spec["steps"] / wall)
    row.update({"step_seconds": wall / spec["steps"], "losses": losses, "tokens_per_step": tokens,
                "device": torch.cuda.get_device_name() if cuda else "cpu",
                "gpu_peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
                "image_tokens_per_step": batches.rows * batches.images * batches.image_tokens})
    return row


def freeze_tower(model) -> None:
    """finetune.vision=frozen: the ViT frozen, its patch merger (the projector) and the language model train."""
    for name, p in model.model.visual.named_parameters():
        p.requires_grad_(name.startswith("merger."))


def run_resident_compile(spec: dict, segments: bool = False, checkpointing: bool | None = None) -> list[dict]:
    """`segments`: the tower's attention through megatrain's one SDPA call per segment length
    (model/vision/attention.py) instead of transformers' one per window: what of megatrain's speed is that alone.
    `checkpointing` None: compiled_resident_run's rule (without, and with only when that runs out of memory); True:
    always with activation checkpointing (resident-compile-ckpt: the other half of "best of with and without")."""
    import torch

    from megatrain_ray.config.load import load_config
    from megatrain_ray.model.vision.attention import use_segment_attention

    o = load_config(spec["config"]).optimizer
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def build(checkpointing: bool):
        model = random_model(vl_config(spec["layers"], spec["tiny"]), device)
        if segments:
            use_segment_attention(model.model.visual)
        freeze_tower(model)
        model.config.use_cache = False
        if checkpointing:
            model.gradient_checkpointing_enable()
        for layer in model.model.language_model.layers:
            layer.compile()
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                                fused=device == "cuda")

        def train_step(inputs):
            loss = model(**inputs).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trained, o.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        return model, train_step

    rows = []
    for tokens in spec["token_counts"]:
        timed = lambda step: timed_vision_steps(spec, tokens, step)  # noqa: E731
        if checkpointing:
            model, train_step = build(True)
            row, used = timed(train_step), True
            train_step = None  # its closure holds the model and optimizer: else they live through the next build
        else:
            row, used, model = compiled_resident_run(build, timed)
        row.update(compiled=True, checkpointing=used, tower_attention="segments" if segments else "per window",
                   precision="bf16 weights, bf16 AdamW states (torch fused AdamW on the GPU)")
        emit(row)
        rows.append(row)
        del model
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def run_deepspeed(spec: dict) -> list[dict]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    import transformers

    from megatrain_ray.config.load import load_config

    o = load_config(spec["config"]).optimizer
    ds_config = zero3_offload_config(o, spec["token_counts"][0] // spec["seq_len"])
    deepspeed.init_distributed(dist_backend="nccl")
    config = vl_config(spec["layers"], spec["tiny"])
    config._attn_implementation = "sdpa"
    started = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    freeze_tower(model)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                      config=ds_config)
    startup = time.perf_counter() - started

    def train_step(inputs):
        loss = engine(**inputs).loss
        engine.backward(loss)
        engine.step()
        return loss

    from megatrain_ray.observe.metrics import proc_status_bytes

    rows = []
    for tokens in spec["token_counts"]:
        row = timed_vision_steps(spec, tokens, train_step)
        row.update(host_gib=proc_status_bytes("VmRSS") / 2**30, startup_seconds=startup,
                   precision="bf16 compute, fp32 master and AdamW states on the CPU (ZeRO-3 offload)")
        emit(row)
        rows.append(row)
    return rows


def emit(row: dict) -> None:
    print(RESULT_TAG + json.dumps({**row, "status": "ok"}), flush=True)


def child(system: str, spec: dict) -> None:
    """One process's systems; every row it finishes is printed as it finishes (a later failure keeps them)."""
    try:
        if system == "build":
            emit(build_model_dir(spec))
        elif system in MEGATRAIN_SYSTEMS:
            emit(run_megatrain_vision({**spec, "overrides": [*spec["overrides"], *MEGATRAIN_SYSTEMS[system]]}))
        else:
            {"resident-compile": run_resident_compile, "deepspeed": run_deepspeed,
             "resident-compile-ckpt": lambda s: run_resident_compile(s, checkpointing=True),
             "resident-compile-segments": lambda s: run_resident_compile(s, segments=True)}[system](spec)
    except Exception as exc:  # noqa: BLE001 - a failed point is a result too
        text = f"{type(exc).__name__}: {exc}"
        print(RESULT_TAG + json.dumps({"status": "oom" if "out of memory" in text.lower() else "error",
                                       "error": text[-2000:], "traceback": traceback.format_exc()[-4000:]}),
              flush=True)
