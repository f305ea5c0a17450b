"""The engine's functions through torch.compile (engine.compile): the decoder layer, the loss head's chunk and an NF4
base's dequantization.

Shapes are fixed per run (the weights of every layer are views at the same offsets), so one graph per sequence
shape serves every layer (per sequence shape and layer kind for Gemma, whose sliding and global layers differ in
their LayerSpec). With engine.compile auto, a failure to compile (no Triton or C compiler: Dynamo wraps it in
BackendCompilerFailed) is logged once and the eager function runs from then on; with true it propagates. It
surfaces at the call that compiles, before the function computed anything, so the eager function in its place
loses nothing.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from megatrain_ray.config.resolved import RunSpec
from megatrain_ray.model.layer_spec import LayerSpec
from megatrain_ray.model.moe import RouterRecord, grouped_mm_usable
from megatrain_ray.model.templates import decoder_layer, decoder_layer_routing
from megatrain_ray.observe.log import get_logger, warn_once

log = get_logger(__name__)


def compile_in_process() -> None:
    """Inductor compiles in the calling process, not in a pool of worker processes, unless the user set
    TORCHINDUCTOR_COMPILE_THREADS. The pool stays alive for the whole run: on the H200 box its processes held
    about 5 GiB of host RAM (node memory 49.9 GiB against 44.9 in process, the same 4-layer Qwen3-30B-A3B run;
    benchmarks/results/compile-threads-*-h200-20261126-*.json and docs/memory-and-long-context.md), RAM a
    memory-bound run needs, while its start-up took no longer in process (34.8 s against 37.3). A value the user
    set in code stays; so does a pool that an earlier compile in this process started."""
    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return
    import torch._inductor.config as inductor_config
    decide = getattr(inductor_config, "decide_compile_threads", None)  # torch's default for this machine
    threads = getattr(inductor_config, "compile_threads", 1)
    if threads == 1 or (decide is not None and threads not in (None, decide())):  # in process, or the user's
        return
    inductor_config.compile_threads = 1
    log.info("torch.compile: Inductor compiles in this process (set TORCHINDUCTOR_COMPILE_THREADS for a pool of "
             "compile workers)")


class CompiledFunction:
    """`eager` through torch.compile, or `eager` itself once compiling failed (engine.compile auto)."""

    def __init__(self, eager: Any, fall_back: bool, what: str, dynamic: bool = False) -> None:
        """`dynamic`: one graph for every shape (torch.compile's dynamic shapes), where the shapes vary."""
        compile_in_process()
        self.eager = eager
        self.fn = torch.compile(eager, dynamic=dynamic)
        self.fall_back = fall_back
        self.failed = False
        self.what = what

    def __call__(self, *args: Any) -> Any:
        return self.eager(*args) if self.failed else self._compiled(self.fn, self.eager, *args)

    def _compiled(self, fn: Any, eager: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if not self.fall_back:
                raise
            self.failed = True
            warn_once(log, f"engine.compile=auto: torch.compile of {self.what} failed "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                           "it runs eagerly. Set engine.compile=false: that skips the attempt, and the "
                           "memory plan then budgets the GPU for eager layers, which need more")
            return eager(*args)


class CompiledDecoderLayer(CompiledFunction):
    """templates.decoder_layer through torch.compile, with decoder_layer's arguments. A MoE layer's routing record
    (`router`) is never handed to the compiled code: templates.decoder_layer_routing records into a record of its
    own and returns its tensors, which are added to `router` here, so the compiled code changes no object of its
    caller's."""

    def __init__(self, fall_back: bool, run: RunSpec | None = None, mlp_chunk_tokens: int = 0) -> None:
        """`run` and `mlp_chunk_tokens` (engine.mlp_chunk_tokens): what for_inputs decides by (None: no engine)."""
        super().__init__(decoder_layer, fall_back, "the decoder layer")
        self.routing_fn = torch.compile(decoder_layer_routing, dynamic=False)
        self.run, self.mlp_chunk_tokens = run, mlp_chunk_tokens

    def for_inputs(self, x: torch.Tensor, documents: Any, w: Mapping[str, torch.Tensor], spec: LayerSpec) -> Any:
        """This compiled layer for plain rows whose MLP runs in one piece, a MoE layer's where its expert products
        take torch._grouped_mm (fixed shapes); else templates.decoder_layer."""
        assert self.run is not None
        if self.failed or not self.run.runs_compiled(x.shape[0] * x.shape[1], self.mlp_chunk_tokens,
                                                      documents is not None):
            return decoder_layer
        if spec.moe is not None and not grouped_mm_usable(x.view(-1, x.shape[-1]), w["mlp.experts.gate_up_proj"],
                                                         w["mlp.experts.down_proj"]):
            warn_once(log, "engine.compile: MoE layers run eagerly on this device (torch._grouped_mm needs bfloat16 "
                           "on an sm90 GPU); the memory plan budgeted them compiled, which need less")
            return decoder_layer
        return self

    def __call__(self, x, w, rope, spec, documents=None, mlp_chunk_tokens: int = 0,
                 router: RouterRecord | None = None) -> torch.Tensor:
        if router is None:
            return super().__call__(x, w, rope, spec, documents, mlp_chunk_tokens)
        if self.failed:
            return decoder_layer(x, w, rope, spec, documents, mlp_chunk_tokens, router)
        y, counts, prob_sum, rows = self._compiled(self.routing_fn, decoder_layer_routing,
                                                   x, w, rope, spec, documents, mlp_chunk_tokens)
        router.add(counts, prob_sum, rows)
        return y
