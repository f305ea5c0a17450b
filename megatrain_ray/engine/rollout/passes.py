"""The built-in rollout engine's passes through the layer stream: one prefill over the left-padded prompts, then one
decode pass per generated token with every row together (no loop over rows), each pass through every stage with its
KV cache (model/decode.py). A mixin of StreamEngine, like engine/forward_only.py: the weights come from the same
WeightStream, so a resident stage is read where it lives and a streamed one is copied in; LoRA adapters and an NF4
base arrive bound as in training (the engine's _load / _bind)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from megatrain_ray.engine.rollout.graphs import DecodeGraph, graph_or_eager
from megatrain_ray.engine.rollout.interface import RolloutResult, SamplingSettings
from megatrain_ray.engine.rollout.sampling import next_tokens
from megatrain_ray.engine.rollout.weights import (MergedBaseView, ResidentBaseView, RolloutWeights, choose_resident,
                                                  resident_bytes)
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.decode import (
    LayerCache,
    Start,
    cache_capacity,
    cache_mask,
    cached_decoder_layer,
    layer_cache,
    positions_of,
)
from megatrain_ray.model.head import head_logits
from megatrain_ray.model.recurrent_decode import RecurrentCache
from megatrain_ray.model.templates import embed

SYNC_EVERY = 16
"""Decode steps between the checks whether every row has stopped (each check waits for the GPU)."""


class RolloutPasses:
    """A base of StreamEngine: generation reads its weights, specs, RoPE cache and head spec, and updates nothing."""

    binds_adapters = False
    """The layers' weights come bound with LoRA adapters (engine/lora_engine.py): no resident copy of plain weights."""
    refresh_on_generate = True
    """Each generation first copies the host's new weights into the rollout's own copy. False in a separate rollout
    worker (actors/rollout_worker.py), which takes them only when told (refresh_rollout_weights), between the
    trainer's updates: the optimizer may be writing the host's copy while it generates."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingSettings) -> RolloutResult:
        """One completion per prompt (RolloutEngine.generate)."""
        if self.generic is not None:
            raise ConfigError("generation runs on the native templates only; this model uses model.template: "
                              "generic (transformers' own modules), which has no KV-cache path here")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows, longest, new = len(prompts), max(len(p) for p in prompts), sampling.max_new_tokens
        capacity = longest + new
        if capacity > self.model_cfg.max_position_embeddings:
            raise ConfigError(f"a prompt of {longest} tokens plus {new} new tokens exceeds the model's "
                              f"max_position_embeddings={self.model_cfg.max_position_embeddings}")
        device = self.device
        ids = torch.zeros((rows, longest), dtype=torch.int64)  # the padding's ids are never attended to
        valid = torch.ones((rows, cache_capacity(capacity)), dtype=torch.bool)
        valid[:, capacity:] = False  # slots past the last token (whole key chunks): never written
        for r, prompt in enumerate(prompts):  # left padding: every row's next token lands at the same index
            ids[r, longest - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
            valid[r, :longest - len(prompt)] = False
        ids, valid = ids.to(device), valid.to(device)
        positions = positions_of(valid)
        caches = [layer_cache(rows, spec, valid.shape[1], self.compute_dtype, device) for spec in self.specs]
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
        stop = torch.tensor(sampling.stop_token_ids, dtype=torch.int64, device=device)
        tokens = torch.full((rows, new), sampling.pad_token_id, dtype=torch.int64, device=device)
        logps = torch.zeros((rows, new), dtype=torch.float32, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        lengths = torch.zeros(rows, dtype=torch.int64, device=device)

        cache_bytes = sum(c.nbytes for c in caches)
        t_sync = time.perf_counter()
        self.weights.invalidate()  # the slots may hold weights from before the last update
        copy = self._rollout_copy(cache_bytes)
        try:
            t0 = time.perf_counter()
            logits = self._rollout_pass(ids, 0, valid, positions, caches, copy)

            experts_in_nf4 = self._experts_in_nf4(copy)
            if experts_in_nf4:
                self.weights.invalidate()  # the slots hold prefill's dense layers: decode reloads each in NF4

            def decode(token: torch.Tensor, index: Start) -> torch.Tensor:
                self.weights.experts_in_nf4 = experts_in_nf4
                try:
                    return self._rollout_pass(token[:, None], index, valid, positions, caches, copy)
                finally:
                    self.weights.experts_in_nf4 = False

            kept = tuple(t for c in caches if isinstance(c, RecurrentCache) for t in c.tensors)
            step = graph_or_eager(decode, self._graph_applies(copy), rows, longest, device, kept) \
                if new > 1 else decode
            self._synchronize()
            t1 = time.perf_counter()
            for t in range(new):
                token, logp = next_tokens(logits, sampling, generator)
                live = ~done
                tokens[:, t] = torch.where(live, token, sampling.pad_token_id)
                logps[:, t] = torch.where(live, logp.float(), 0.0)
                lengths += live
                done |= live & torch.isin(token, stop)
                # Stop once every row has (most rollouts end before the limit), asked every SYNC_EVERY tokens only:
                # a host sync per token would keep the CPU from queueing the next steps while the GPU runs this one.
                if t + 1 == new or ((t + 1) % SYNC_EVERY == 0 and bool(done.all())):
                    break
                # a stopped row decodes on (its tokens are dropped): the batch keeps one shape, no row is special
                logits = step(token, longest + t)
            self._synchronize()
            t2 = time.perf_counter()
            self.weights.end_step()
        finally:
            t_restore = time.perf_counter()
            if isinstance(copy, MergedBaseView):
                copy.restore()  # the base as training reads it, however the generation ended
            restore_s = time.perf_counter() - t_restore
        generated = int(lengths.sum())
        steps = int(lengths.max())  # the decode steps past the last row's end produced padding only
        stats = {"weights_sync_s": t0 - t_sync, "weights_restore_s": restore_s, "prefill_s": t1 - t0,
                 "decode_s": t2 - t1,
                 "generated_tokens": float(generated), "weights_resident": float(copy is not None),
                 "lora_merged": float(isinstance(copy, MergedBaseView)),
                 "cuda_graph": float(isinstance(step, DecodeGraph)),
                 "decode_steps": float(steps), "tokens_per_s": generated / max(t2 - t0, 1e-9),
                 "experts_in_nf4": float(new > 1 and experts_in_nf4),
                 "kv_cache_bytes": float(cache_bytes)}
        return RolloutResult(tokens[:, :steps].cpu(), logps[:, :steps].cpu(), lengths.cpu(), done.cpu(), stats)

    def _rollout_copy(self, cache_bytes: int) -> RolloutWeights | ResidentBaseView | None:
        """The rollout's resident weights, refreshed (engine.rollout_weights resolved now), or None: streamed. LoRA
        with every base layer resident reads them where they are (ResidentBaseView), unless streamed is asked; with
        engine.rollout_lora merged, with the adapters folded in for this generation (MergedBaseView)."""
        if self.binds_adapters:
            if self.engine_cfg.rollout_weights == "streamed" or not ResidentBaseView.applies(self):
                return None
            merged = self.engine_cfg.rollout_lora == "merged" and MergedBaseView.applies(self)
            return MergedBaseView(self) if merged else ResidentBaseView(self)
        if not self.refresh_on_generate:
            if getattr(self, "_rollout_weights", None) is None:
                raise RuntimeError("this rollout worker holds no weights yet: refresh_rollout_weights() first")
            return self._rollout_weights
        own = [s for s in self.layout.stages if not (s.kind == "layer" and self.resident.holds(s))]
        wanted = choose_resident(self.engine_cfg.rollout_weights, self.device, self.binds_adapters,
                                 resident_bytes(own, self.compute_dtype), cache_bytes)
        if not wanted:
            self._rollout_weights = None  # memory back to training
            return None
        if getattr(self, "_rollout_weights", None) is None:
            self._rollout_weights = RolloutWeights(own, self.compute_dtype, self.device)
        self._rollout_weights.refresh(self.weights.store, self.updates.wait)
        return self._rollout_weights

    def refresh_rollout_weights(self) -> int:
        """(A separate rollout worker: refresh_on_generate False, no layer of its own resident, no LoRA) Copy every
        stage's streaming copy from the host into the rollout's own copy on the device, allocated on the first call;
        its bytes."""
        if self.binds_adapters or self.resident.stages:
            raise RuntimeError("refresh_rollout_weights serves a full fine-tune's rollout worker, which keeps no "
                               "layer resident with training state")
        if getattr(self, "_rollout_weights", None) is None:
            self._rollout_weights = RolloutWeights(list(self.layout.stages), self.compute_dtype, self.device)
        self._rollout_weights.refresh(self.weights.store, lambda index: None)  # the trainer flushed its updates
        return resident_bytes(list(self.layout.stages), self.compute_dtype)

    def _experts_in_nf4(self, copy: RolloutWeights | ResidentBaseView | None) -> bool:
        """A decode step reads the MoE layers' experts in NF4 where they lie (engine/packed_stream.py): an NF4 base
        streamed through the slots, MoE layers, and no LoRA adapter on the experts (an adapted expert tensor is
        formed dense, model/lora_moe.py). Prefill, with every prompt token routed, dequantizes as training does."""
        packed = self.weights.packed
        if copy is not None or packed is None or all(s.moe is None for s in self.specs):
            return False
        adapters = getattr(self, "adapters", None)
        adapted = adapters is not None and any(name.startswith("mlp.experts") for i in range(len(self.layout.layers))
                                               for name in adapters.layer(i))
        return not adapted and any(packed.keeps_experts(s) for s in self.layout.layers)

    def _graph_applies(self, copy: RolloutWeights | ResidentBaseView | None) -> bool:
        """A decode step can be one CUDA graph (engine/rollout/graphs.py): on a GPU, resident weights, dense layers,
        RoPE tables that do not switch with the length."""
        scaling = self.model_cfg.rope_scaling
        return (copy is not None and self.device.type == "cuda" and all(s.moe is None for s in self.specs)
                and not (scaling is not None and scaling.rope_type == "longrope"))

    def _rollout_pass(self, ids: torch.Tensor, start: Start, valid: torch.Tensor, positions: torch.Tensor,
                      caches: list[LayerCache], copy: RolloutWeights | ResidentBaseView | None) -> torch.Tensor:
        """Embedding, every layer through its cache, the final norm and LM head at each row's last token:
        [rows, vocab] logits in float32 (float64 when computing in it). `copy`: the resident weights, else the
        stages stream through the training slots."""
        count, capacity = ids.shape[1], valid.shape[1]
        if copy is None:
            self.weights.begin_step(False)
            embed_slot = self.weights.load(self.layout.embed)
            embed_w = self._embed_weight(self.weights.bind(self.layout.embed, embed_slot))
        else:
            embed_w = self._embed_weight(copy.bound(self.layout.embed))
        x = embed(ids, embed_w, self.embed_scale)
        here = positions[:, start:start + count] if isinstance(start, int) else positions.index_select(1, start.view(1))
        rope = self.rope_cache.tables(capacity, here)
        masks = {window: cache_mask(valid, start, count, window) for window in {s.sliding_window for s in self.specs}}
        stages = self._stage_weights(copy)
        specs = self._rollout_specs()
        for i, w in zip(range(len(self.layout.layers)), stages):
            spec = specs[i]
            x = cached_decoder_layer(x, w, rope[spec.local_rope], spec, caches[i], start, masks[spec.sliding_window],
                                     self.mlp_chunk, valid)
        head_w = next(stages)
        logits = head_logits(x[:, -1], head_w["model.norm.weight"], self._lm_weight(head_w, embed_w), self.head_spec)
        next(stages, None)  # the head's slot released
        if copy is None:
            self.weights.release(embed_slot)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _rollout_specs(self) -> tuple:
        """The layers' specs for generation: LoRA adapters added in place (LayerSpec.lora_inplace; no autograd)."""
        cached = getattr(self, "_rollout_spec_cache", None)
        if cached is None or cached[0] is not self.specs:
            cached = self._rollout_spec_cache = (self.specs, tuple(replace(s, lora_inplace=True) for s in self.specs))
        return cached[1]

    def _stage_weights(self, copy: RolloutWeights | ResidentBaseView | None) -> Iterator[dict[str, torch.Tensor]]:
        """Each layer's bound weights in order, then the head's: from the resident copy (the GPU-resident tier's
        layers where they live), or streamed, the next stage loading while one computes, each slot released once
        the caller asks for the next."""
        if copy is not None:
            for stage in self.layout.layers:
                yield copy.bound(stage) if copy.holds(stage) else self.resident.weights(stage)
            yield copy.bound(self.layout.head)
            return
        layers = self.layout.layers
        upcoming = self._load(layers[0])
        for i, stage in enumerate(layers):
            slot = upcoming
            upcoming = self._load(layers[i + 1] if i + 1 < len(layers) else self.layout.head)
            yield self._bind(stage, slot)
            self._release(slot)
        yield self.weights.bind(self.layout.head, upcoming)  # the head always streams (never resident)
        self.weights.release(upcoming)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
