"""The rollout engine: batched sampling with a KV cache over the current policy, in the GPU worker beside the
streamed trainer (GRPO's completions, `megatrain generate`).

interface.py: what a rollout engine is (generate, update_weights, release, resume) and what it takes and returns;
sampling.py: temperature, top-k and top-p sampling with per-token log-probabilities; passes.py: the engine's
prefill and decode passes through the layer stream (model/decode.py's cached decoder layer)."""
