"""The generic path's templates: transformers' own modules run statelessly on the streamed weights.

Each decoder layer is the model's own layer module, its parameters on the meta device
(config/hf_generic.py), called with torch.func.functional_call on the views of its stage's flat buffer: no
module holds a weight. The embedding and the final norm are called the same way; the loss stays the
engine's chunked cross-entropy on the LM head's logits. The modules' buffers (an embedding scale) are
their own, moved to the device; persistent buffers and frozen parameters (requires_grad=False) are read from
the model directory where it holds them, as transformers loads them (load_fixed). A mixture of experts' router
logits are captured as its layers compute them, for the load-balancing loss (model/generic_moe.py).

What the model's forward hands each layer besides the hidden states (the rotary embedding's cos and sin,
the causal or sliding-window mask of its attention implementation, position ids, per-layer choices such as
layer_types) comes from the model's own forward, run once per batch shape on a *shell*: a second copy of
the model whose layers, final norm and LM head only record their inputs, its rotary module (inverse
frequencies as its constructor computed them) on the device. Those inputs are reused by every step of
that shape and by the recomputed backward.

On construction the shell's forward is checked with random probes: each layer is called once in order and
receives the previous one's output, the final norm the last one's, the layers' side inputs do not depend
on the embeddings, and what the model does between the embedding module and the first layer and to the LM
head's output is nothing or a constant factor (Granite's embedding_multiplier; Cohere's logit_scale,
Granite's logits_scaling), which is applied, or the soft-cap config.json names (final_logit_softcapping:
cap * tanh(logits / cap), Gemma 2's and Gemma 4's), which the chunked loss applies as for the native Gemma 2;
anything else is refused.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch.func import functional_call

from megatrain_ray.config.hf_generic import GenericArchitecture, UnsupportedModelError, build_architecture
from megatrain_ray.config.model_section import ModelConfig
from megatrain_ray.model.generic_moe import GenericRouting, call_recording, generic_routing
from megatrain_ray.model.head import HeadResult, HeadSpec, head_loss_and_grads
from megatrain_ray.model.hf_io import HFDirectory
from megatrain_ray.model.moe import RouterRecord

LayerInputs = tuple[tuple[Any, ...], dict[str, Any]]
"""What the model's forward passes a decoder layer besides the hidden states: positional and keyword arguments."""

PROBE_TOKENS = 5
"""Sequence length of the construction-time probe of the model's forward."""
PROBE_SCALE = 10.0
"""Standard deviation of the probe's random hidden states."""


def run_layer(x: torch.Tensor, w: Mapping[str, torch.Tensor], inputs: LayerInputs, layer: Any,
              documents: Any = None, mlp_chunk_tokens: int = 0, router: RouterRecord | None = None) -> torch.Tensor:
    """One decoder layer: the model's own module on the weights `w` (views of the streamed buffer; its
    buffers its own). The signature is the native decoder_layer's, so templates.decoder_layer_backward
    recomputes it as it is. `router`: where a MoE layer's routers record their logits' statistics (the
    load-balancing loss, model/generic_moe.py)."""
    args, kwargs = inputs
    out = call_recording(layer, lambda: functional_call(layer, dict(w), (x, *args), kwargs), router)
    return out[0] if isinstance(out, tuple) else out


def buffers_to(module: Any, device: torch.device) -> None:
    """Move every buffer of `module` to `device`, and its frozen parameters that were loaded (load_fixed); its
    other parameters (on the meta device) stay."""
    for part in module.modules():
        for name, buffer in part._buffers.items():
            if buffer is not None:
                part._buffers[name] = buffer.to(device)
        for name, param in part._parameters.items():
            if param is not None and param.device.type != "meta":
                part._parameters[name] = torch.nn.Parameter(param.detach().to(device), requires_grad=False)


def load_fixed(arch: GenericArchitecture, model_dir: str, dtype: torch.dtype = torch.float32) -> None:
    """The tensors the model holds but does not train, as model_dir's weights hold them (as transformers loads
    them): its persistent buffers (Apertus's activation constants; those the directory lacks keep their
    constructor's values) and its frozen parameters (Ernie 4.5-MoE's routing bias, DeepSeek-V3.2's indexer), made
    real tensors in place of their meta ones: in the compute `dtype`, as the model's other weights, or in float32
    where the class keeps that module in float32 (_keep_in_fp32_modules[_strict]: Ernie's `moe_statics`)."""
    buffers, frozen = arch.persistent_buffers, arch.frozen_parameters
    if not buffers and not frozen:
        return
    source = HFDirectory(model_dir)
    for name, buffer in buffers.items():
        if name in source:
            buffer.copy_(source[name])  # the module's own buffer (state_dict shares its storage)
    kept32 = [*(getattr(arch.model, "_keep_in_fp32_modules", None) or []),
              *(getattr(arch.model, "_keep_in_fp32_modules_strict", None) or [])]
    for name in frozen:
        owner, _, leaf = name.rpartition(".")
        module = arch.model.get_submodule(owner)
        value = source[name].to(torch.float32 if any(k in name for k in kept32) else dtype)
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)


def constant_factor(out: torch.Tensor, given: torch.Tensor) -> float | None:
    """c where out == c * given (1.0 when equal), else None."""
    out, given = out.float(), given.float()
    if torch.equal(out, given):
        return 1.0
    factor = float((out * given).sum() / given.square().sum())
    return factor if torch.allclose(out, given * factor, rtol=1e-5, atol=0.0) else None


def _same(a: Any, b: Any) -> bool:
    """Equal side inputs: tensors by value, containers item by item, anything else by identity or ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return a is b or bool(a == b)
    except Exception:
        return False


class _Shell:
    """The model's forward with its layers, final norm and LM head recording their inputs (see the module
    docstring); the rotary module, the only part with state the forward needs, built on the device."""

    def __init__(self, model_dir: str, device: torch.device, tuple_outputs: bool):
        """`tuple_outputs`: the recording layers return (hidden_states,), for models whose forward takes a
        layer's output as outputs[0] (Falcon)."""
        arch = build_architecture(model_dir)
        self.arch, self.calls, self.tuple_outputs = arch, [], tuple_outputs
        self.norm_input: torch.Tensor | None = None
        if getattr(arch.model.config, "output_router_logits", False):  # no router runs here: nothing to pool
            arch.model.config.output_router_logits = False
        for i, layer in enumerate(arch.layers):
            layer.forward = self._layer_recorder(i)  # the instance keeps its attributes (attention_type, ...)
        arch.norm.forward = self._record_norm
        arch.model.get_output_embeddings().forward = lambda hidden: hidden
        buffers_to(arch.model, device)

    def _layer_recorder(self, index: int):
        def record(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self.calls.append((index, hidden_states, args, kwargs))
            out = hidden_states + (index + 1)  # distinct outputs, so the probe sees what reaches the next
            return (out,) if self.tuple_outputs else out
        return record

    def _record_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.norm_input = hidden_states
        return hidden_states + 0.5

    @torch.no_grad()
    def run(self, embeds: torch.Tensor) -> tuple[list, torch.Tensor | None, torch.Tensor]:
        """(the layers' calls in order, the final norm's input, the causal LM's logits) for these embeddings."""
        self.calls, self.norm_input = [], None
        logits = self.arch.model(inputs_embeds=embeds, use_cache=False).logits
        return self.calls, self.norm_input, logits


class GenericTemplate:
    """The generic path as the engine calls it: embedding, layers (forward and recomputed backward), head."""

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
        arch = build_architecture(cfg.path)
        if dtype == torch.float64 and getattr(arch.model.config, "_experts_implementation", None) == "grouped_mm":
            arch.model.set_experts_implementation("eager")  # grouped_mm, transformers' default, has no float64 kernel
        load_fixed(arch, cfg.path, dtype)
        buffers_to(arch.model, device)
        self.arch: GenericArchitecture = arch
        self.layers = list(arch.layers)
        self.routing: GenericRouting | None = generic_routing(arch)
        """A MoE model's routers and load-balancing loss (None: a dense model)."""
        self.device, self.dtype = device, dtype
        self._inputs: dict[tuple[int, int], list[LayerInputs]] = {}
        self.shell, (self.embed_scale, self.logit_scale, self.softcap) = self._probed_shell(cfg.path)

    # ------------------------------------------------------------------ per batch shape

    def _probed_shell(self, model_dir: str) -> tuple[_Shell, tuple[float, float, float]]:
        """The shell whose layers return what the model's forward expects (a tensor, else a 1-tuple), probed.
        A 1-tuple is accepted only where every check of the probe passes; else the tensor's failure is told."""
        failure: Exception | None = None
        for tuple_outputs in (False, True):
            shell = _Shell(model_dir, self.device, tuple_outputs)
            try:
                return shell, self._probe(shell)
            except Exception as exc:  # refused, or the forward could not run with these recording layers
                failure = failure or exc
        if isinstance(failure, UnsupportedModelError):
            raise failure
        raise UnsupportedModelError(f"{self.arch.class_name} cannot run on the generic path: its forward fails "
                                    f"with its layers replaced by recorders ({type(failure).__name__}: "
                                    f"{failure})") from None

    def _probe(self, shell: _Shell) -> tuple[float, float, float]:
        """Check the model's forward (see the module docstring); returns its factors on the embedding module's
        output and on the LM head's, and its logits' soft-cap (0: none)."""
        name, hidden = self.arch.class_name, self.arch.model.config.hidden_size
        gen = torch.Generator().manual_seed(0)
        # In float32 whatever the compute dtype (a property of the forward, not of rounding), and large enough
        # that a soft-cap of the logits (30 for Gemma 2) is far from linear.
        first = (PROBE_SCALE * torch.randn(1, PROBE_TOKENS, hidden, generator=gen)).to(self.device)
        second = (PROBE_SCALE * torch.randn(1, PROBE_TOKENS, hidden, generator=gen)).to(self.device)
        calls, norm_input, logits = shell.run(first)
        other_calls, _, _ = shell.run(second)

        def refuse(why: str) -> UnsupportedModelError:
            return UnsupportedModelError(f"{name} cannot run on the generic path: {why}")

        if [c[0] for c in calls] != list(range(len(self.layers))):
            raise refuse(f"its forward calls its decoder layers as {[c[0] for c in calls]}, not each once in order")
        embed_scale = constant_factor(calls[0][1], first)
        if embed_scale is None:
            raise refuse("its forward transforms the embeddings before the first layer other than by a constant "
                         "factor")
        expected = calls[0][1]
        for index, hidden_states, _, _ in calls:
            if not torch.equal(hidden_states, expected):
                raise refuse(f"its forward changes the hidden states before decoder layer {index}")
            expected = hidden_states + (index + 1)
        if norm_input is None or not torch.equal(norm_input, expected):
            raise refuse("its forward does more than the final norm between the last layer and the LM head")
        for (index, _, args, kwargs), (_, _, args2, kwargs2) in zip(calls, other_calls):
            if not (_same(args, args2) and _same(kwargs, kwargs2)):
                raise refuse(f"decoder layer {index} takes inputs computed from the embeddings beside the hidden "
                             "states")
        logit_scale = constant_factor(logits, norm_input + 0.5)
        if logit_scale is not None:
            return embed_scale, logit_scale, 0.0
        cap = getattr(self.arch.model.config, "final_logit_softcapping", None)
        if isinstance(cap, (int, float)) and cap > 0:
            capped = torch.tanh((norm_input + 0.5) / cap) * cap
            if torch.allclose(logits.float(), capped.float(), rtol=1e-5, atol=1e-5 * cap):
                return embed_scale, 1.0, float(cap)
        raise refuse("its causal LM transforms the LM head's logits other than by a constant factor or the "
                     "soft-cap its config.json names (final_logit_softcapping), which the chunked loss does not "
                     "reproduce")

    def layer_inputs(self, batch: int, seq_len: int) -> list[LayerInputs]:
        """Each layer's side inputs for rows of seq_len tokens at positions 0..seq_len-1 (one document per
        row), from the model's own forward; computed once per shape."""
        key = (batch, seq_len)
        if key not in self._inputs:
            embeds = torch.zeros(batch, seq_len, self.arch.model.config.hidden_size, device=self.device,
                                 dtype=self.dtype)
            calls, _, _ = self.shell.run(embeds)
            self._inputs[key] = [(args, kwargs) for _, _, args, kwargs in calls]
        return self._inputs[key]

    # ------------------------------------------------------------------ stages

    def embed_matrix(self, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return w[self.arch.embed_weight_name]

    def _embedded(self, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = functional_call(self.arch.embedding, {"weight": weight}, (ids,))
        return out if self.embed_scale == 1.0 else out * self.embed_scale

    def embed(self, ids: torch.Tensor, w: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self._embedded(ids, self.embed_matrix(w))

    def embed_grad(self, ids: torch.Tensor, grad_y: torch.Tensor, w: Mapping[str, torch.Tensor],
                   acc: torch.Tensor) -> None:
        """Add the embedding matrix's gradient into `acc`, through the module's own backward (its padding row
        gets none, a scale in the module or the forward is honoured): a dense [vocab, hidden] temporary."""
        weight = self.embed_matrix(w).detach().requires_grad_(True)
        with torch.enable_grad():
            out = self._embedded(ids, weight)
            (grad,) = torch.autograd.grad(out, weight, grad_y.to(out.dtype))
        acc.add_(grad.to(acc.dtype))

    def layer(self, index: int, x: torch.Tensor, w: Mapping[str, torch.Tensor],
              inputs: list[LayerInputs], router: RouterRecord | None = None) -> torch.Tensor:
        return run_layer(x, w, inputs[index], self.layers[index], router=router)

    def _norm_params(self, head_w: Mapping[str, torch.Tensor], grads: bool) -> dict[str, torch.Tensor]:
        prefix = self.arch.norm_prefix
        return {n[len(prefix):]: t.detach().requires_grad_(grads) for n, t in head_w.items() if n.startswith(prefix)}

    def lm_matrix(self, head_w: Mapping[str, torch.Tensor], embed_w: torch.Tensor) -> torch.Tensor:
        return head_w.get(self.arch.lm_head_weight_name, embed_w)

    def head_logits(self, x: torch.Tensor, head_w: Mapping[str, torch.Tensor], embed_w: torch.Tensor) -> torch.Tensor:
        normed = functional_call(self.arch.norm, self._norm_params(head_w, False), (x,))
        logits = F.linear(normed, self.lm_matrix(head_w, embed_w))
        logits = logits if self.logit_scale == 1.0 else logits * self.logit_scale
        return torch.tanh(logits / self.softcap) * self.softcap if self.softcap else logits

    def head_loss(self, x: torch.Tensor, head_w: Mapping[str, torch.Tensor], embed_w: torch.Tensor,
                  labels: torch.Tensor, n_valid: int, chunk_tokens: int,
                  grad_lm_acc: torch.Tensor | None) -> tuple[HeadResult, dict[str, torch.Tensor]]:
        """The chunked loss (head.head_loss_and_grads) after the model's own final norm; the logit factor
        is folded into the normed states (logits = (s h) W^T). Returns the result and the head stage's
        gradients by name: the norm's, and grad_lm_acc for an untied LM head (none without grad_lm_acc)."""
        with_grads = grad_lm_acc is not None
        x = x.detach().requires_grad_(with_grads)
        params = self._norm_params(head_w, with_grads)
        with torch.set_grad_enabled(with_grads):
            normed = functional_call(self.arch.norm, params, (x,))
            if self.logit_scale != 1.0:
                normed = normed * self.logit_scale
        result = head_loss_and_grads(normed.detach(), None, self.lm_matrix(head_w, embed_w), labels, n_valid,
                                     HeadSpec(0.0, softcap=self.softcap), chunk_tokens, grad_lm_acc)
        if not with_grads:
            return result, {}
        grads = torch.autograd.grad(normed, [x, *params.values()], result.grad_x)
        result.grad_x = grads[0]
        head_grads = {self.arch.norm_prefix + n: g for n, g in zip(params, grads[1:])}
        if not self.arch.tied:
            head_grads[self.arch.lm_head_weight_name] = grad_lm_acc
        return result, head_grads
