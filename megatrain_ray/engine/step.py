"""The double-buffered layer stream: one training step, stage by stage.

Forward: the embedding, then each layer, then the head. While layer i computes on one device
buffer, layer i+1 is copied host->device into the other (the H2D stream); the input of each
layer (the boundary activation) is kept, nothing else. The head computes the loss and its
gradients in token chunks. Backward walks the layers in reverse: reload the layer's weights,
recompute it with autograd on, take the gradients of its input and weights, copy the weight
gradients device->host on the D2H stream, and hand the stage to the optimizer workers.

Updates: with clipping off, each stage's update is ordered as soon as its gradients are on
the host, overlapping the rest of the backward. With exact clipping on, the global norm is
known only after the whole backward; the updates are then ordered in forward order, so the
next step's forward of stage i waits only for stage i's update.

The whole batch goes through stage i before stage i+1: no gradient accumulation buffers.
Long sequences: the MLP runs in chunks of engine.mlp_chunk_tokens tokens; the kept layer inputs
can live in pinned host memory instead of the GPU (engine.activation_offload, engine/activations.py).

Data parallel (megatrain_ray/engine/collective.py): each rank runs this loop on its slice of the
batch; a stage's gradients are summed over the ranks on the device before the D2H, each rank copies
its piece of the sum, and only the node's first rank orders updates. With one rank none of it runs.

The parts: weights in (engine/weights.py), gradients out (engine/grads.py), updates ordered
(engine/updates.py), the stages kept whole on the device (engine/resident.py, engine.gpu_resident: no
copies, their update on the device at the streamed stages' point of the step), the step's measurements
(engine/telemetry.py), the RoPE tables (engine/rope_cache.py); the head and backward (engine/backward.py; the
resident layers whose forward keeps its graph, no recompute: engine/kept_graphs.py) and the passes without
gradients (logits, evaluation loss, DPO's reference log-probabilities: engine/forward_only.py) are its base
classes'. This class computes and wires them; the settings derived from the config are resolved here, once, and
handed to them.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatrain_ray.config.engine_sections import EngineConfig, OptimizerConfig
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.config.runtime_sections import ParallelConfig
from megatrain_ray.dtypes import TORCH_DTYPES
from megatrain_ray.engine.activations import ActivationStash
from megatrain_ray.engine.backward import BackwardPasses
from megatrain_ray.engine.collective import Collectives, RankInfo, StageSync, global_totals
from megatrain_ray.engine.compiled import CompiledDecoderLayer, CompiledFunction
from megatrain_ray.engine.forward_only import ForwardOnlyPasses
from megatrain_ray.engine.grads import GradientSink
from megatrain_ray.engine.kept_graphs import KeptLayer, forward_kept
from megatrain_ray.engine.resident import ResidentTier
from megatrain_ray.engine.resident_update import resident_update_function
from megatrain_ray.engine.rollout.passes import RolloutPasses
from megatrain_ray.engine.rope_cache import RopeCache
from megatrain_ray.engine.router_aux import RouterAux
from megatrain_ray.engine.streams import DeviceStreams
from megatrain_ray.engine.telemetry import StepTelemetry, UpdateTrace
from megatrain_ray.engine.updates import UpdateDispatch
from megatrain_ray.engine.weights import WeightSlot, WeightStream
from megatrain_ray.messages import Batch, StepResult
from megatrain_ray.model.attention import DocumentBucket, document_buckets
from megatrain_ray.model.generic_template import GenericTemplate
from megatrain_ray.model.head import HeadSpec, chunk_cross_entropy
from megatrain_ray.model.layer_spec import LayerSpec, layer_specs
from megatrain_ray.model.layout import ModelLayout, StageLayout
from megatrain_ray.model.templates import decoder_layer, embed, embed_scale
from megatrain_ray.observe.log import get_logger
from megatrain_ray.quant.nf4_stage import decode_blocks
from megatrain_ray.store.segments import HostStore

log = get_logger(__name__)


class StreamEngine(BackwardPasses, ForwardOnlyPasses, RolloutPasses):
    def __init__(self, model: ModelConfig, engine: EngineConfig, parallel: ParallelConfig, optimizer: OptimizerConfig,
                 run: RunSpec, layout: ModelLayout, store: HostStore, optimizers: list[Any], device: torch.device,
                 rank: RankInfo | None = None):
        """The config sections the layer stream reads (model, engine, parallel, optimizer: its clipping, and AdamW
        for the resident stages), and `run`:
        the settings the driver derived from the config and the machine; `optimizers`: the node's
        OptimizerWorker handles (only its first rank gets them); `rank`: this worker's place in a data-parallel
        run (None: the only one)."""
        self.model_cfg, self.engine_cfg = model, engine
        self.run = run
        self.rank = rank = rank or RankInfo()
        self.layout = layout
        self.device = device
        self.streams = DeviceStreams(device, dequantizes=run.base_quantization == "nf4")
        # One spec per layer (Gemma's sliding and global layers differ), the head's, the embedding's scale.
        self.specs = layer_specs(model)
        self.head_spec = HeadSpec.from_config(model)
        # The run's derived settings (RunSpec), turned into what the parts take.
        self.compute_dtype = TORCH_DTYPES[run.compute_dtype]
        # model.template generic: transformers' own modules on the streamed weights, called where the native
        # templates are (embedding, layers, head); None for the native templates.
        self.generic = GenericTemplate(model, device, self.compute_dtype) if model.template == "generic" else None
        stream_dtype = TORCH_DTYPES[run.stream_dtype]
        host_grad_dtype = TORCH_DTYPES[run.grad_dtype]
        host_grad_home = run.grad_home
        slab_numel = layout.max_layer_numel if run.vocab_in_pieces else 0
        compiles = run.compiles
        self.offload = run.activation_offload
        # Accumulation of the vocabulary-sized gradients and of norms: float32, or float64 when computing in it.
        self.acc_dtype = torch.promote_types(self.compute_dtype, torch.float32)
        self.embed_scale = embed_scale(model, self.compute_dtype)
        self.clip = optimizer.grad_clip
        self.mlp_chunk = self.engine_cfg.mlp_chunk_tokens
        fall_back = self.engine_cfg.compile == "auto"
        self._compiled = CompiledDecoderLayer(fall_back, run, self.mlp_chunk) if compiles else None
        # The loss head's chunks wherever engine.compile is on for this device, whatever the layers do: upcast,
        # softmax and gradient fused over the [tokens, vocab] logits.
        self._chunk_loss = CompiledFunction(chunk_cross_entropy, fall_back, "the loss head's chunk") \
            if run.device_compiles else chunk_cross_entropy
        self.router_aux = RouterAux(model, self.generic.routing if self.generic is not None else None)
        poison = self.engine_cfg.poison_buffers

        trace = UpdateTrace(self.engine_cfg.update_trace, rank.rank, rank.world) if self.engine_cfg.update_trace else None
        self.telemetry = StepTelemetry(self.streams, trace)
        sync = StageSync(store.get("sync", 0), rank, len(layout.stages), parallel.timeout_s) \
            if rank.local_world > 1 else None
        speculative = layout.speculative_stages(run.speculative_stages, run.resident_layers, run.resident_vocab)
        self.updates = UpdateDispatch(rank, sync, optimizers, self.telemetry, defer=self.clip > 0,
                                      speculative=speculative, store=store)
        self.speculative_redone = 0
        if speculative:
            log.info("speculative updates (optimizer.speculative_stages): %s, during the backward into their "
                     "second sets", ", ".join(layout.stages[i].name for i in speculative))
        self.weights = WeightStream(layout, store, self.streams, self.telemetry, self.updates, rank, stream_dtype,
                                    self.compute_dtype, poison, parallel.gather_weights,
                                    run.resident_layers, frozen=run.frozen_base,
                                    decode=CompiledFunction(decode_blocks, fall_back, "the NF4 dequantization",
                                                            dynamic=True) if run.device_compiles else None,
                                    nf4_kernels=self.engine_cfg.nf4_kernels)
        # A frozen base (LoRA, engine/lora_engine.py) sends no gradients to the host: no sink, no vocabulary sums.
        self.grads = None if run.frozen_base else GradientSink(
            layout, store, self.streams, self.telemetry, self.updates, rank, host_grad_dtype, self.acc_dtype,
            host_grad_home, self.engine_cfg.grad_slabs, slab_numel, poison)
        # Filled by the GPU worker (the run's initial state, a checkpoint), which has no host segments for it. A
        # frozen base keeps only its weights on the device (engine/resident_base.py, the LoRA engine's).
        self.resident = ResidentTier(layout, 0 if run.frozen_base else run.resident_layers, optimizer, device,
                                     TORCH_DTYPES[run.master_dtype], stream_dtype, self.compute_dtype,
                                     host_grad_dtype, poison, vocab=run.resident_vocab and not run.frozen_base,
                                     fused=resident_update_function(device, run.device_compiles,
                                                                    TORCH_DTYPES[run.master_dtype], fall_back),
                                     timed=lambda: self.telemetry.device_update(self.streams.compute))
        # Resident layers whose forward keeps its graph (engine/kept_graphs.py), by position; this step's graphs.
        self.kept_positions = {s.index - 1 for s in layout.kept_stages(run.resident_layers, run.kept_layers)} \
            if not run.frozen_base and self.generic is None else set()
        self.kept_graphs: dict[int, KeptLayer] = {}
        v, h = self.model_cfg.vocab_size, self.model_cfg.hidden_size
        self.vocab_acc = None if run.frozen_base else torch.zeros((v, h), dtype=self.acc_dtype, device=device)
        self.trainable: Any = None
        """Which of a layer's bound tensors get gradients in the backward (None: all of them)."""
        self._comm: Collectives | None = None
        self._nan_armed = False
        """Fault drill `nan_grad` armed for the next train_step (arm_nan_grad)."""
        self.rope_cache = RopeCache(model, self.specs, device, self.compute_dtype)
        # Pinned host buffers of offloaded layer inputs live as long as the engine: allocated once.
        self.activations = ActivationStash(self.streams, self.offload, len(layout.layers), self.telemetry.copied)

    @property
    def comm(self) -> Collectives | None:
        """The process group, attached by the GPU worker once every rank has joined (several ranks only)."""
        return self._comm

    @comm.setter
    def comm(self, comm: Collectives | None) -> None:
        self._comm = self.weights.comm = self.grads.comm = comm

    def arm_nan_grad(self) -> None:
        """Fault drill `nan_grad`: the next train_step puts a NaN into the first layer's gradients."""
        self._nan_armed = True

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def train_step(self, batch: Batch, lr: float, adam_step: int, loss_tokens: int) -> StepResult:
        """One optimizer step on this rank's rows of the batch.

        The loss is the mean over the tokens whose label counts (labels != -100) in the whole batch:
        `loss_tokens` of them (the driver counts them; with one rank, those of `batch`).
        """
        t0 = time.perf_counter()
        inject_nan, self._nan_armed = self._nan_armed, False
        self._begin(training=True)
        step = self.updates.begin_step(lr, adam_step)
        trace, trace_origin = self.telemetry.trace, None
        if trace is not None:  # the device is idle here (the last step synchronised): its clock meets the host's
            trace_origin = (time.perf_counter(), self.streams.record(self.streams.compute, timing=True))
            self.telemetry.mark("step_start", -1, step)
        n_valid = max(1, loss_tokens)
        ids = batch.input_ids.to(self.device, non_blocking=True)
        labels = batch.labels.to(self.device, non_blocking=True)

        x, embed_slot, embed_w, rope, documents = self._forward(ids, batch, self.activations)
        head = self._head(x, embed_w, labels, n_valid, batch)
        aux = self.router_aux.finish_forward(self._comm, self.rank.rank == 0)
        if aux is not None:  # as transformers: the loss includes router_aux_loss_coef * the load-balancing loss
            head.loss_sum = head.loss_sum + aux
        del x  # else the last hidden state, [tokens, hidden], lives through the whole backward
        grad_y = self._backward(head, rope, documents, inject_nan)
        self._embedding(ids, grad_y, embed_slot)
        self.telemetry.mark("backward_end", -1, step)
        # The device is still far behind this thread (the whole backward may be queued). Wait for it here,
        # where the GIL is let go: blocking in the reads below instead (the all-reduce of the totals, their
        # copy to the host) kept the dispatcher threads of a node's ranks from handing over the last
        # stages' updates until the device was done (0.45 s of waiting per step on two H200s).
        self.streams.drain(self.streams.compute)
        self.telemetry.mark("device_idle", -1, step)
        loss, grad_norm = self._totals(head.loss_sum, step)
        skipped = self._order_deferred_updates(loss, grad_norm)
        self.weights.end_step()

        device_seconds = self.telemetry.timeline.seconds()
        if trace is not None:
            self.telemetry.mark("step_end", -1, step)
            trace.write(trace_origin)
        peak = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        stats = self.telemetry.stats
        return StepResult(
            loss=loss, grad_norm=grad_norm, tokens=ids.numel(), valid_tokens=n_valid,
            seconds=time.perf_counter() - t0, update_wait_seconds=stats["update_wait_seconds"],
            slab_wait_seconds=stats["slab_wait_seconds"],
            optimizer_seconds=stats["optimizer_seconds"],
            optimizer_bytes=int(stats["optimizer_bytes"]), h2d_bytes=int(stats["h2d_bytes"]),
            d2h_bytes=int(stats["d2h_bytes"]), compute_seconds=device_seconds["compute"],
            device_update_seconds=device_seconds["update"],
            h2d_seconds=device_seconds["h2d"], d2h_seconds=device_seconds["d2h"], skipped=skipped, gpu_peak_bytes=peak,
            comm_seconds=device_seconds["comm"], vision_seconds=device_seconds["vision"],
            objective_metrics={k: float(v) for k, v in head.metrics.items()}
            if batch.preference is not None or batch.policy is not None else None,
            aux_loss=None if self.router_aux.loss is None else float(self.router_aux.loss),
            speculative_redone=self.speculative_redone if self.updates.speculative else None,
            token_logps=head.token_logps.cpu() if batch.policy is not None else None)

    def _begin(self, training: bool) -> None:
        self.telemetry.new_step()
        self.kept_graphs = {}  # a step that failed leaves none behind
        self._begin_gradients()
        self.weights.begin_step(training)
        self.router_aux.begin(training)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _begin_gradients(self) -> None:
        """A step's gradient sinks start empty (LoRA's engine: its adapters' instead)."""
        self.grads.begin_step()

    # ------------------------------------------------------------------ forward

    def _layer(self, x: torch.Tensor, documents: Any, w: dict[str, torch.Tensor], spec: LayerSpec) -> Any:
        """The decoder-layer template for these inputs: compiled where it takes them, else the eager function."""
        return decoder_layer if self._compiled is None else self._compiled.for_inputs(x, documents, w, spec)

    def _forward(self, ids: torch.Tensor, batch: Batch,
                 keep: ActivationStash | None) -> tuple[torch.Tensor, WeightSlot | None, torch.Tensor, tuple, Any]:
        """Embedding and layers over `ids` (the batch's ids on the device); returns the last hidden state,
        the embedding's slot and weight, the RoPE tables and the document buckets (packed rows) that the
        backward reuses."""
        documents = document_buckets(batch.segments, self.device) if batch.segments is not None else None
        embed_slot = None if self.resident.holds(self.layout.embed) else self.weights.load(self.layout.embed)
        embed_bound = self._vocab_weights(self.layout.embed, embed_slot)
        if self.generic is not None:  # "rope": each layer's side inputs from the model's own forward
            rope, embed_w = self.generic.layer_inputs(*ids.shape), self.generic.embed_matrix(embed_bound)
            x = self.generic.embed(ids, embed_bound)
        else:
            rope, embed_w = self.rope_cache.tables(ids.shape[1], batch.positions), self._embed_weight(embed_bound)
            x = embed(ids, embed_w, self.embed_scale)
        x = self._forward_layers(x, rope, documents, keep)
        return x, embed_slot, embed_w, rope, documents

    def _forward_layers(self, x: torch.Tensor, rope: dict, documents: tuple[DocumentBucket, ...] | None,
                        keep: ActivationStash | None) -> torch.Tensor:
        """Each layer in turn, the next one's weights loading meanwhile (the LM head's after the last); the
        layer inputs go to `keep` (training)."""
        layers, timeline = self.layout.layers, self.telemetry.timeline
        upcoming = self._load(layers[0])
        for i, stage in enumerate(layers):
            slot = upcoming
            upcoming = self._load(layers[i + 1] if i + 1 < len(layers) else self.layout.head)
            if keep is not None:
                keep.put(i, x)
            w = self._bind(stage, slot)
            start = timeline.start(self.streams.compute)
            if self.generic is not None:
                x = self.generic.layer(i, x, w, rope, self.router_aux.record(i))
            else:
                spec = self.specs[i]
                layer = self._layer(x, documents, w, spec)
                if keep is not None and i in self.kept_positions:  # its graph kept for the backward: no recompute
                    x, self.kept_graphs[i] = forward_kept(layer, x, w, rope[spec.local_rope], spec, documents,
                                                          self.mlp_chunk, self.trainable, self.router_aux.record(i))
                else:
                    x = layer(x, w, rope[spec.local_rope], spec, documents, self.mlp_chunk, self.router_aux.record(i))
            x = self._layer_output(i, x)
            timeline.stop("compute", self.streams.compute, start)
            self._release(slot)
        return x

    def _layer_output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's output as the next layer takes it (a vision-language model adds Qwen3-VL's deepstack
        features here: engine/vision_engine.py)."""
        return x

    def _embed_weight(self, bound: dict[str, torch.Tensor]) -> torch.Tensor:
        """The embedding matrix the step reads (the streamed one; LoRA's modules_to_save: its trained copy)."""
        return bound["embed_tokens.weight"]

    def _lm_weight(self, head_w: dict[str, torch.Tensor], embed_w: torch.Tensor) -> torch.Tensor:
        """The LM head's matrix: its own, or the embedding's when tied."""
        return head_w.get("lm_head.weight", embed_w)

    def _load(self, stage: StageLayout) -> WeightSlot | None:
        """Start the stage's H2D copy; None for a resident stage (its weights are on the device)."""
        return None if self.resident.holds(stage) else self.weights.load(stage)

    def _bind(self, stage: StageLayout, slot: WeightSlot | None) -> dict[str, torch.Tensor]:
        return self.resident.weights(stage) if slot is None else self.weights.bind(stage, slot)

    def _release(self, slot: WeightSlot | None) -> None:
        if slot is not None:
            self.weights.release(slot)

    # ------------------------------------------------------------------ finish

    def _totals(self, loss_sum: torch.Tensor, step: int) -> tuple[float, float]:
        """The step's loss and gradient norm: this rank's, or over all ranks (which also compares the nodes)."""
        if self._comm is None:
            return float(loss_sum), float(self.grads.sqnorm.sqrt())
        return global_totals(self._comm, self.rank, loss_sum, self.grads.sqnorm, self.weights.take_checksum(), step)

    def _order_deferred_updates(self, loss: float, grad_norm: float) -> bool:
        """With clipping on, order the updates held back for the global norm; returns whether the step is
        dropped (a non-finite norm or loss)."""
        if self.clip <= 0:
            return False
        skipped = not (torch.isfinite(torch.tensor(grad_norm)) and torch.isfinite(torch.tensor(loss)))
        # Dropped step: weights stay as they are, but the streaming copies that hold gradients must be
        # rewritten from the master weights before the next forward reads them. Else exact global clipping,
        # as torch.nn.utils.clip_grad_norm_: scale = min(1, clip / (norm + 1e-6)).
        coef = 1.0 if skipped else min(1.0, self.clip / (grad_norm + 1e-6))
        self.speculative_redone = self.updates.order_deferred(coef=coef, apply=not skipped)
        # The resident stages' updates after the CPU's are ordered: the CPU starts first, the device's are short.
        self.resident.apply_deferred(coef, not skipped, self.updates.lr, self.updates.adam_step)
        return skipped

    def flush(self) -> float:
        """Wait for every ordered update; returns the optimizer seconds they took."""
        return self.updates.flush()

    def close(self) -> None:
        self.updates.close()
        if self.telemetry.trace is not None:
            self.telemetry.trace.write(None)
        # Let go of every device buffer and pinned activation buffer now: a closed engine can outlive
        # its run (a reference cycle, a caller's handle), and the next run in this process needs the memory.
        self.weights.close()
        if self.grads is not None:
            self.grads.close()
        self.resident.close()
        self.vocab_acc = None
        self.rope_cache.clear()
        self.activations.release()
