#!/usr/bin/env bash
# The GPU-machine runs the open issues name, one device call each (each fits the 10-minute limit).
#
#   bash benchmarks/device_runs.sh NAME        (on the GPU machine, from the repository root)
#
# Every run writes its JSON into $OUT (the device tool brings it back) or benchmarks/results/.
# Names and the issue each run answers:
#   gpu-tests     tests/gpu/test_gpu.py (bf16 parity, copy overlap, peak vs depth, Ray path, 32K-token chunked
#                 + offloaded step against the unchunked one, offloaded peak flat in depth)      any GPU
#   load-8b       issue 5: load time and peak RAM of an 8B sharded checkpoint (random bf16)      nvidia-h200 / h100
#   long-context  issue 8: 8B-width layers at 128K/256K/512K tokens, activation offload on       nvidia-h200
#   long-context-depth  issue 8: depth 8 at 128K (against 4 layers: GPU peak flat in depth)      nvidia-h200
#   long-context-1m  issue 8: the same 4 layers at 1M tokens in one sequence (one step; plan 118 GiB)  nvidia-h200
#   traces        the GPU traces the plan's activation terms come from: 7B width at 64K tokens eager
#                 and compiled (8 layers), 8B width at 128K (4 layers, chunked MLP)             nvidia-h200
#   attention     SDPA kernels (torch's pick, flash, cuDNN, efficient) at 8K-256K tokens of an 8B
#                 layer: time and memory of forward + backward (what long context runs on)     any GPU
#   largest-h200  issue 8: Llama 3.1 8B, all 32 layers, full precision (fp32 master and moments,
#                 master streamed, clipping off) on the 128 GiB box; the plan beside the figures nvidia-h200
#   bench-3.5b    issue 4: the 3.5B bench against the GPU-resident baseline and DeepSpeed
#                 (WITH_DEEPSPEED=1 before sourcing the bundle; BATCHES=4 or 16,32: all three
#                 take more than one call; SYSTEMS overrides the four systems)                                                       nvidia-h200
#   depth-offload issue 4: 7B-width layers at 64k tokens, depth 8/16/24, inputs offloaded          nvidia-h200
#                 (SYSTEMS=megatrain-noclip-eager,megatrain-noclip: eager and compiled side by side;
#                 engine.compile is auto, i.e. on, on the GPU)
#   adamw-8k      issue 4: the 8k optimizer-bound point with 2 and 4 optimizer workers, and the
#                 AdamW microbenchmark, on one box (the AdamW rate fell from 4.3-4.7 to 3.7)   nvidia-h200
#   qwen14b-x2    issue 4: Qwen2.5-14B shape, 24 layers side by side with DeepSpeed, then all 48 against DeepSpeed (which refuses
#                 them when its own host-memory estimate exceeds RAM)
#                 (WITH_DEEPSPEED=1; QWEN_LAYERS picks the depths)                   nvidia-h200-x2
#   largest-x2    issue 8: the largest dense shape at full precision in 256 GiB: Qwen2.5-14B width
#                 at LAYERS (64: 19.2 B parameters, plan 219 GiB of host RAM, 12.3 B/param)      nvidia-h200-x2
#   tiers-x2      issue 8: the largest with the memory tiers: Qwen2.5-32B width at LAYERS (56: 28.9 B) with
#                 both moments in bf16 (not full precision), in RAM (plan 222 GiB, 8.3 B/param); TIER=disk
#                 puts them on disk (4.3 B/param RAM; 56 layers need 116 GB of disk, 64 need 131)  nvidia-h200-x2
#   dp-x2         issue 9: 1 vs 2 GPUs at the same per-GPU batch on the 3.5B bench shape, clipping
#                 on and off (SYSTEMS overrides), then the 2-GPU NCCL parity test (NCCL_TEST=0 skips)  nvidia-h200-x2
#   optim-x2      issue 7: CPU AdamW for 1..32 workers with and without H2D                      nvidia-h200-x2
#   qwen32b-x4    issue 48: Qwen2.5-32B shape, all 64 layers, fp32 master and moments, 10 steps on one GPU of the
#                 512 GiB box (GPUS=4: on four)                                                   nvidia-h200-x4
#   dp-x4         issue 48: 1, 2 and 4 GPUs at the same per-GPU batch on the 3.5B bench shape, clipping on and
#                 off (SYSTEMS, GPUS override)                                                    nvidia-h200-x4
#   grpo-step     issue 49: a GRPO step in MegaTrain's configuration (Qwen2.5-7B shape, 8 x 2 completions, 512 +
#                 1024 tokens, full precision): rollout / sync / train seconds, beside transformers' generate nvidia-h200
#   llama8b-8k    issue 45: Llama-3.1-8B shape, full precision, clipping on, 8k tokens: the default config against
#                 engine.gpu_resident=none (megatrain-streamed; vs_streamed)                      nvidia-h200
#   moe-tier-64k  issue 45: Qwen3-30B-A3B width, 4 layers, 64k tokens (8 x 8192): the default config (the tier)
#                 against resident-compile (SYSTEMS adds resident), then PROFILE=1 the tier's profiler trace nvidia-h200
#   lean-8k       issue 46: the 3.5B bench at 8k tokens, streamed, clipping on: optimizer.state full against
#                 lean (megatrain-streamed-lean; vs_streamed is lean over full), host B/param            nvidia-h200
#   lean-pretrain issue 46: a 0.525 B Llama shape (20 layers of 1280) pre-trained 2,000 steps byte-level on the
#                 machine's Python stdlib, lean against full: PART=1 (default) runs both side by side to the deadline
#                 (full on 2 cores finishes; lean, cut, saves a checkpoint in runs/lean-pretrain-state), PART=2 in
#                 the next call while the machine is still warm continues lean alone on every core and writes the
#                 JSON of both                                                                    nvidia-h200
#   qwen35-8l     issue 43: Qwen3.5-27B's first 8 layers (6 linear-attention, 2 full), 32k tokens, full precision:
#                 the default config against transformers resident-compile (its torch fallback for the gated delta
#                 rule without flash-linear-attention; PyTorch's expandable segments, without which its retry with
#                 checkpointing found 56 GiB reserved and failed), then one linear and one full-attention layer's
#                 forward and recompute + backward time, eager (MODES="eager compiled" adds compiled; PROFILE_ONLY=1
#                 runs the layers alone) (benchmarks/layer_profile.py, 3 repeats)                nvidia-h200
#   vision-32k-ds issue 44: the Qwen2.5-VL-7B shape (4 of 28 layers, 4 images of 448x448 a sample) at 32k tokens:
#                 DeepSpeed ZeRO-3 offload beside megatrain streamed (WITH_DEEPSPEED=1 before install.sh; the last
#                 try stopped DeepSpeed at 67 s, still starting)                                 nvidia-h200
#   decode-step   issue 49: one rollout decode step of the Qwen2.5-32B shape (LoRA r 16, 2 rows) as a CUDA graph at
#                 1k/4k/12.8k-token caches: the attention and LoRA variants, attention alone, the copy-rate bound  nvidia-h200
#   grpo-lora-32b issue 49: Qwen2.5-32B shape LoRA (r 16, all linear), 1 prompt x 2 completions of 12,288 tokens, the
#                 base GPU-resident; first a 31-pass decode probe with engine.rollout_lora adapters and merged, then
#                 the step merged (B drawn at std 0.01); the result rewritten at each phase (a cut-off run keeps its
#                 figures)                                                                         nvidia-h200
#   grpo-lora-32b-tt  the same step without the probes, with the per-token importance-sampling mode
#                 (vllm_importance_sampling_mode=token_truncate), under which 12,288-token completions train   nvidia-h200
#   nf4-decode    issue 49: the NF4 Triton kernels on CUDA (tests/unit/test_nf4_triton.py's CHECKS, bit for bit and
#                 within measured noise), then benchmarks/nf4_decode.py on a gpt-oss-120b layer: the stage's
#                 dequantization (compiled torch against Triton) and a decode step's MoE half at 32/8/1 rows, every
#                 expert dequantized against the routed ones read in NF4                            any GPU
#   grpo-gpt-oss-120b  issue 49: gpt-oss-120b, NF4 base, LoRA r 16 on attention, every packed layer GPU-resident,
#                 engine.nf4_kernels=triton (KERNELS=torch: the dequantizing path, for its rollout/trainer gap):
#                 3 GRPO steps of 8 prompts x 4 completions of 1,024 tokens (prompt 512), token_truncate ratios
#                 (IS_MODE overrides; sequence_mask weighed every token 0 at a 0.58-nat gap), s/step, host and GPU
#                 against the plan; start-up 176 s + 130 s a step: give the call its whole 600 s  nvidia-h200
#   grpo-qwen35-27b  issues 43/49: GRPO on a hybrid, Qwen3.5-27B (48 Gated DeltaNet + 16 gated attention layers),
#                 LoRA r 16 all-linear on a bf16 base every layer GPU-resident (the decode step one CUDA graph with the
#                 recurrent states), MegaTrain's GRPO shape (8 prompts x 2, 512 + 1024 tokens), 2 steps: rollout /
#                 train s, the rollout/trainer gap, memory against the plan                     nvidia-h200
#   grpo-x2       issue 49: MegaTrain's 7B GRPO configuration (8 x 2 completions, 512 + 1024 tokens, full precision)
#                 colocated, then with the rollout on the second GPU on-policy (rl.rollout: separate) and one step
#                 ahead (rl.async_steps: 1), 3 steps each, through the Trainer on Ray (MODES overrides)     nvidia-h200-x2
#   qwen35-397b-x2  issue 43: Qwen3.5-397B-A17B's text model, NF4 base, LoRA r 16 on the attention and Gated
#                 DeltaNet projections, 2 x 4096 tokens, 5 steps (1 warm-up) on one GPU of the 256 GiB box: loss,
#                 host and GPU memory against the plan (195 GiB host planned)                        nvidia-h200-x2
set -euo pipefail
OUT=${OUT:-benchmarks/results}
export MEGATRAIN_COMMIT=${MEGATRAIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

case "${1:-}" in
  gpu-tests)
    python -m pytest -q tests/gpu/test_gpu.py -m gpu -s ;;
  grpo-step)
    python benchmarks/grpo_step.py --out "$OUT" ;;
  llama8b-8k)
    python benchmarks/run.py --config configs/shapes/llama3-8b.yaml --systems megatrain,megatrain-streamed --batches 2 \
      --seq-lens 4096 --steps 4 --warmup 2 --no-roofline --timeout 260 --name llama8b-8k-default-vs-streamed \
      --out "$OUT" --set checkpoint.at_end=false --set checkpoint.every=0 ;;
  moe-tier-64k)
    python benchmarks/run.py --config configs/shapes/qwen3-30b-a3b.yaml --layers 4 --batches 8 --seq-lens 8192 \
      --systems "${SYSTEMS:-megatrain,resident-compile}" --steps 3 --warmup 2 --no-roofline --timeout 240 \
      --name moe-qwen3-30b-a3b-4l-64k-tier --out "$OUT"
    if [ "${PROFILE:-0}" = 1 ]; then
      python benchmarks/tier_profile.py --config configs/shapes/qwen3-30b-a3b.yaml --set model.num_layers=4 \
        --set data.batch_size=8 --set data.seq_len=8192 --steps 2 --warmup 2 \
        --name tier-profile-qwen3-30b-a3b-4l-64k --out "$OUT"
    fi ;;
  lean-8k)
    python benchmarks/run.py --config configs/shapes/llama-3.5b-bench.yaml --batches 4 \
      --systems megatrain-streamed,megatrain-streamed-lean --steps 4 --warmup 2 --no-roofline --timeout 200 \
      --name bench-3.5b-8k-lean-vs-full --out "$OUT" ;;
  lean-pretrain)
    state=runs/lean-pretrain-state
    if [ "${PART:-1}" = 2 ]; then
      # PART=1's checkpoint lives on the warm machine only: a fresh one would start lean over from step 0
      if [ ! -f "$state/lean-pretrain-partial-lean.json" ]; then
        echo "lean-pretrain PART=2: $state holds no PART=1 run (the machine was given back?)" >&2
        exit 3
      fi
      part=(--variants lean)
    else part=(--full-cores 14,15); fi
    python benchmarks/lean_pretrain.py --hidden 1280 --intermediate 5120 --layers 20 --heads 20 \
      --state-dir "$state" --deadline-s 540 --out "$OUT" "${part[@]}" ;;
  qwen35-8l)
    if [ "${PROFILE_ONLY:-0}" != 1 ]; then
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/run.py \
        --config configs/shapes/qwen3.5-27b-8l-bench.yaml --batches 8 \
        --systems "${SYSTEMS:-megatrain,resident-compile}" --steps 3 --warmup 2 --no-roofline --timeout 300 \
        --name qwen3.5-27b-8l-32k-vs-resident --out "$OUT"
    fi
    for layer in 0 3; do  # a linear-attention (Gated DeltaNet) layer, then a gated full-attention one
      python benchmarks/layer_profile.py --config configs/shapes/qwen3.5-27b-8l-bench.yaml --tokens 32768 \
        --seq-len 4096 --layer "$layer" --modes ${MODES:-eager} --repeats 3 --out "$OUT"
    done ;;
  vision-32k-ds)
    python benchmarks/vision_bench.py --tokens 32768 --layers 4 --steps 2 --warmup 1 \
      --systems "${SYSTEMS:-deepspeed,megatrain-streamed}" --point-limit-s deepspeed=400 --budget-s 540 --out "$OUT" ;;
  nf4-decode)
    python -c "import ast; m = ast.parse(open('tests/unit/test_nf4_triton.py').read()); exec(next(n.value.value \
      for n in m.body if isinstance(n, ast.Assign) and getattr(n.targets[0], 'id', '') == 'CHECKS'))" cuda
    python benchmarks/nf4_decode.py --config configs/shapes/gpt-oss-120b-qlora.yaml --out "$OUT" ;;
  grpo-gpt-oss-120b)
    python benchmarks/grpo_step.py --config configs/shapes/gpt-oss-120b-qlora.yaml --steps 3 --prompts 8 \
      --generations 4 --prompt-len 512 --completion-len 1024 --lora-b-std 0.01 --no-baseline --out "$OUT" \
      --name "grpo-gpt-oss-120b-nf4-${KERNELS:-triton}" --set engine.gpu_resident=36 \
      --set "engine.nf4_kernels=${KERNELS:-triton}" \
      --set "finetune.grpo.vllm_importance_sampling_mode=${IS_MODE:-token_truncate}" ;;
  qwen35-397b-x2)
    python benchmarks/run.py --config configs/shapes/qwen3.5-397b-a17b.yaml --systems megatrain --batches 2 \
      --seq-lens 4096 --steps 4 --warmup 1 --no-roofline --timeout 570 --name qwen3.5-397b-a17b-nf4-lora-x2 \
      --out "$OUT" --set finetune.method=lora --set finetune.lora.base_quantization=nf4 --set finetune.lora.r=16 \
      --set finetune.lora.lora_alpha=32 --set precision.stream_dtype=bfloat16 --set optimizer.lr=2e-4 \
      --set 'finetune.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj]' \
      --set checkpoint.at_end=false ;;
  grpo-qwen35-27b)
    python benchmarks/grpo_step.py --config configs/shapes/qwen3.5-27b.yaml --steps 2 --prompts 8 --generations 2 \
      --prompt-len 512 --completion-len 1024 --lora-b-std 0.01 --no-baseline --out "$OUT" \
      --name grpo-qwen3.5-27b-lora --set finetune.method=lora --set finetune.lora.r=16 \
      --set finetune.lora.lora_alpha=32 --set finetune.lora.target_modules=all-linear \
      --set precision.compute_dtype=bfloat16 --set precision.stream_dtype=bfloat16 --set engine.gpu_resident=64 \
      --set optimizer.lr=2e-4 --set optimizer.weight_decay=0.0 \
      --set finetune.grpo.vllm_importance_sampling_mode=token_truncate ;;
  grpo-x2)
    python benchmarks/grpo_two_gpus.py --modes "${MODES:-colocated,separate,separate-async}" --steps 3 --out "$OUT" ;;
  decode-step)
    python benchmarks/decode_step.py --out "$OUT" ;;
  grpo-lora-32b|grpo-lora-32b-tt)
    lora32=(--set engine.rollout_lora=merged --set finetune.method=lora --set finetune.lora.r=16
      --set finetune.lora.lora_alpha=32 --set finetune.lora.target_modules=all-linear
      --set precision.stream_dtype=bfloat16 --set engine.gpu_resident=64 --set engine.compile=false
      --set optimizer.lr=2e-4 --set optimizer.weight_decay=0.0 --set optimizer.grad_clip=1.0)
    if [ "$1" = grpo-lora-32b-tt ]; then
      run=(--name grpo-lora-32b-12k-token-truncate --set finetune.grpo.vllm_importance_sampling_mode=token_truncate)
    else run=(--probe-lora adapters,merged --probe-passes 31 --name grpo-lora-32b-12k); fi
    python benchmarks/grpo_step.py --config configs/shapes/qwen2.5-32b.yaml --steps 1 --prompts 1 --generations 2 \
      --prompt-len 512 --completion-len 12288 --lora-b-std 0.01 --no-baseline --out "$OUT" "${lora32[@]}" "${run[@]}" ;;
  load-8b)
    python benchmarks/load_checkpoint.py --dir /tmp/llama8b-random --layers 32 --shards 2 --out "$OUT" ;;
  long-context)
    python benchmarks/run.py --config configs/shapes/llama3-8b.yaml --systems megatrain --batches 1 --layers 4 \
      --seq-lens 131072,262144,524288 --steps 1 --warmup 1 --timeout 500 --name long-context --out "$OUT" \
      --set engine.activation_offload=true --set optimizer.grad_clip=0 --set precision.stream_dtype=float32 ;;
  long-context-depth)
    python benchmarks/run.py --config configs/shapes/llama3-8b.yaml --systems megatrain --batches 1 --layers 8 \
      --seq-lens 131072 --steps 1 --warmup 1 --name long-context-depth --out "$OUT" \
      --set engine.activation_offload=true --set optimizer.grad_clip=0 --set precision.stream_dtype=float32 ;;
  long-context-1m)
    python benchmarks/run.py --config configs/shapes/llama3-8b.yaml --systems megatrain --batches 1 --layers 4 \
      --seq-lens 1048576 --steps 1 --warmup 0 --timeout 580 --name long-context-1m --out "$OUT" \
      --set engine.activation_offload=true --set optimizer.grad_clip=0 --set precision.stream_dtype=float32 ;;
  traces)
    for compile in false true; do
      python benchmarks/gpu_memory_peak.py --config configs/shapes/llama-3.5b-bench.yaml --layers 8 --out "$OUT" \
        --set schedule.warmup_steps=0 --set data.batch_size=32 --set engine.activation_offload=true \
        --set optimizer.grad_clip=0 --set engine.compile=$compile
    done
    python benchmarks/gpu_memory_peak.py --config configs/shapes/llama3-8b.yaml --layers 4 --out "$OUT" \
      --set schedule.warmup_steps=0 --set data.batch_size=1 --set data.seq_len=131072 \
      --set model.max_position_embeddings=131072 --set engine.activation_offload=true --set optimizer.grad_clip=0 \
      --set precision.stream_dtype=float32 ;;
  largest-h200)
    python benchmarks/run.py --config configs/shapes/llama3-8b.yaml --systems megatrain --batches 8 --steps 8 --warmup 2 \
      --name largest-h200 --out "$OUT" --set optimizer.grad_clip=0 --set precision.stream_dtype=float32 \
      --set engine.grad_slabs=3 --set optimizer.workers=auto ;;  # 12.4 B/param planned, -0.4 % tok/s against 4 slabs
  bench-3.5b)
    python benchmarks/run.py --config configs/shapes/llama-3.5b-bench.yaml --batches "${BATCHES:-4,16,32}" \
      --systems "${SYSTEMS:-megatrain,megatrain-noclip,resident,deepspeed}" --name bench-3.5b --out "$OUT" ;;
  depth-offload)
    python benchmarks/run.py --config configs/shapes/llama-3.5b-bench.yaml --batches 32 --layers 8,16,24 --steps 3 \
      --warmup 1 --systems "${SYSTEMS:-megatrain-noclip}" --set engine.activation_offload=true --name depth-offload \
      --out "$OUT" ;;
  adamw-8k)
    for workers in 2 4; do
      python benchmarks/run.py --config configs/shapes/llama-3.5b-bench.yaml --batches 4 --systems megatrain-noclip \
        --set optimizer.workers=$workers --name "adamw-8k-workers$workers" --out "$OUT"
    done
    python benchmarks/optimizer_scaling.py --max-workers 16 --out "$OUT" ;;
  qwen14b-x2)
    python benchmarks/run.py --config configs/shapes/qwen2.5-14b.yaml --batches 8 --systems megatrain,deepspeed \
      --layers "${QWEN_LAYERS:-24,48}" --steps 3 --warmup 1 --timeout 420 --name qwen14b-x2 --out "$OUT" ;;
  largest-x2)
    python benchmarks/run.py --config configs/shapes/qwen2.5-14b.yaml --layers "${LAYERS:-64}" --batches 8 --systems megatrain \
      --steps 4 --warmup 1 --name largest-x2 --out "$OUT" --set precision.stream_dtype=float32 \
      --set optimizer.grad_clip=0 --set engine.grad_slabs=3 ;;
  tiers-x2)
    df -h /tmp; mkdir -p /tmp/megatrain-moments
    python benchmarks/run.py --config configs/shapes/qwen2.5-32b.yaml --layers "${LAYERS:-56}" --batches 8 --systems megatrain \
      --steps 3 --warmup 1 --name "tiers-${TIER:-ram}-x2" --out "$OUT" --set optimizer.moment_dtype=bfloat16 \
      --set host.moments_tier="${TIER:-ram}" --set host.disk_dir=/tmp/megatrain-moments \
      --set precision.stream_dtype=float32 --set optimizer.grad_clip=0 --set engine.grad_slabs=3 ;;
  dp-x2)
    trace=$(mktemp -d)
    python benchmarks/run.py --config configs/shapes/llama-3.5b-bench.yaml --batches 16 --systems "${SYSTEMS:-megatrain,megatrain-noclip}" \
      --gpus 1,2 --steps 3 --warmup 1 --name data-parallel-x2 --out "$OUT" --trace "$trace"
    for d in "$trace"/*/; do python benchmarks/update_trace.py "$d" --stages; done
    if [ "${NCCL_TEST:-1}" = 1 ]; then python -m pytest -q tests/gpu/test_gpu.py -m gpu -s -p no:logging -k two_gpus; fi ;;
  dp-x4)
    trace=$(mktemp -d)
    python benchmarks/run.py --config configs/shapes/llama-3.5b-bench.yaml --batches 16 --systems "${SYSTEMS:-megatrain,megatrain-noclip}" \
      --gpus "${GPUS:-1,2,4}" --steps 3 --warmup 1 --name data-parallel-x4 --out "$OUT" --trace "$trace"
    for d in "$trace"/*/; do python benchmarks/update_trace.py "$d" --stages; done ;;
  qwen32b-x4)
    python benchmarks/run.py --config configs/shapes/qwen2.5-32b.yaml --systems megatrain --batches 8 --gpus "${GPUS:-1}" \
      --steps 9 --warmup 1 --timeout 530 --name qwen32b-full-x4 --out "$OUT" --set optimizer.workers=auto \
      --set checkpoint.at_end=false ;;  # no disk on the box for a 393 GB checkpoint
  attention)
    python benchmarks/attention_backends.py --out "$OUT" ;;
  optim-x2)
    python benchmarks/optimizer_scaling.py --max-workers 32 --out "$OUT" ;;
  *)
    sed -n '2,20p' "$0"; exit 2 ;;
esac
