"""The generic path's view of a model class: transformers' causal LM built on the meta device and read for its parts.

For the generic path (any decoder-only causal LM that transformers ships; config/generic_shape.py resolves
model.template and reads the shape the planner takes), the model class that config.json names is built with its parameters on the meta device (no memory, no
weights; its buffers as its constructor computes them) and read for its parts: the embedding module, the
list of decoder layers, the final norm and the LM head. Their parameters become the stages of the layout
under Hugging Face's own names (`model.layers.{i}.<name>`, model/layout.py), so import and export are
name for name; the same model gives the engine its layer modules, run statelessly on the streamed weights
(model/generic_template.py).

Refused here, before Ray starts, with the model class named: encoder and encoder-decoder models, classes
that are not causal LMs, a model directory that asks for its own code (trust_remote_code is never set),
models whose checkpoints transformers converts on load (other names or shapes than its modules) other than by
the expert fusions megatrain's reader undoes (READ_CONVERSIONS), and
models whose parts are not embedding -> layers -> final norm -> LM head (a bias on the LM head, parameters
elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatrain_ray.config.hf import UnsupportedArchitectureError, read_hf_config
from megatrain_ray.exceptions import excerpt


class UnsupportedModelError(UnsupportedArchitectureError):
    """The model of a directory cannot run on the generic path (the message names its class and why)."""


def hf_pretrained_config(model_dir: str | Path, hf: dict[str, Any], where: str):
    """transformers' config object of a model directory, never running the directory's own code."""
    if hf.get("auto_map"):
        raise UnsupportedModelError(
            f"{where} has auto_map ({excerpt(hf.get('architectures'))}): the model needs its own code "
            "(trust_remote_code), which megatrain never runs; use a model class that transformers ships")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise UnsupportedModelError(f"{where}: transformers cannot build a config from it (model_type "
                                    f"{excerpt(hf.get('model_type'))}): {excerpt(str(exc), 300)}") from None


def _causal_class(config, hf: dict[str, Any], where: str) -> type:
    """The ForCausalLM class config.json names (or transformers maps its model_type to); refused for encoders
    and encoder-decoders, naming the class."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = hf.get("architectures")
    named = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{where}: {named or type(config).__name__} is an encoder-decoder model; "
                                    "megatrain trains decoder-only causal language models (…ForCausalLM)")
    if named is not None and named not in causal:
        raise UnsupportedModelError(f"{where}: {named} is not a decoder-only causal language model (an encoder, "
                                    "a classifier or another head); megatrain trains …ForCausalLM models")
    name = named or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise UnsupportedModelError(f"{where}: transformers has no causal LM class for model_type "
                                    f"{excerpt(config.model_type)}; megatrain trains …ForCausalLM models")
    if hasattr(config, "is_decoder") and not config.is_decoder and config.model_type in _ENCODER_TYPES:
        raise UnsupportedModelError(f"{where}: {name} is an encoder configured without is_decoder; megatrain "
                                    "trains decoder-only causal language models")
    return cls


# Encoders that transformers can also build as a causal LM head when is_decoder is set.
_ENCODER_TYPES = {"bert", "roberta", "xlm-roberta", "electra", "ernie", "camembert", "data2vec-text",
                  "bert-generation", "rembert", "roberta-prelayernorm", "xlm-roberta-xl", "megatron-bert"}


class _EmptyOnMeta(torch.overrides.TorchFunctionMode):
    """torch.empty without a device gives a meta tensor: what modules allocate their parameters with (nn.Linear,
    nn.Embedding, transformers' fused experts), so that no parameter is ever allocated on the CPU, not even for the
    moment before it moves to the meta device (DeepSeek-V3's fused experts are 30 GB a layer in float32, which a
    small machine cannot allocate). Buffers are made with other factories (zeros, ones, arange) and stay real."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device (no memory) and their buffers as their
    constructors compute them (RoPE's inverse frequencies, an embedding scale), on the CPU."""
    register = torch.nn.Module.register_parameter

    def register_on_meta(module: torch.nn.Module, name: str, param: Any) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        with _EmptyOnMeta():
            yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


@dataclass(frozen=True)
class GenericArchitecture:
    """The parts of a meta-device model the stream needs, by name."""

    model: Any
    """The ForCausalLM with its parameters on the meta device (parameters_on_meta): its modules run on bound
    weights."""
    class_name: str
    base_prefix: str
    """The base model's prefix in Hugging Face's names (`model.`)."""
    embed_name: str
    """The embedding module's name in the base model (`embed_tokens`)."""
    layers_name: str
    norm_name: str
    lm_head_name: str
    tied: bool

    @property
    def base(self) -> Any:
        return self.model.get_submodule(self.base_prefix[:-1])

    @property
    def layers(self) -> Any:
        return getattr(self.base, self.layers_name)

    @property
    def embedding(self) -> Any:
        return getattr(self.base, self.embed_name)

    @property
    def norm(self) -> Any:
        return getattr(self.base, self.norm_name)

    @property
    def embed_weight_name(self) -> str:
        """The embedding matrix's name in the embed stage (the stage's prefix is base_prefix)."""
        return f"{self.embed_name}.weight"

    @property
    def norm_prefix(self) -> str:
        return f"{self.base_prefix}{self.norm_name}."

    @property
    def lm_head_weight_name(self) -> str:
        return f"{self.lm_head_name}.weight"

    @property
    def persistent_buffers(self) -> dict[str, torch.Tensor]:
        """The model's persistent buffers by Hugging Face name, as its constructor computed them: what its
        state_dict holds besides parameters (Apertus's xIELU activation: beta and eps per layer), which
        transformers loads from a checkpoint where it holds them, and saves."""
        params = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        return {n: t for n, t in self.model.state_dict().items() if n not in params}

    @property
    def frozen_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the model never trains (requires_grad=False: Ernie 4.5-MoE's e_score_correction_bias,
        which its routing adds to the scores it picks experts by) by Hugging Face name: loaded from the
        checkpoint and saved, as transformers does, and no stage's (torch.optim.AdamW skips them too)."""
        return {n: p for n, p in self.model.named_parameters() if not p.requires_grad}


def build_architecture(model_dir: str | Path) -> GenericArchitecture:
    """The model class of `model_dir`'s config.json built with its parameters on the meta device, checked, and
    its parts named."""
    where = str(Path(model_dir) / "config.json")
    hf = read_hf_config(model_dir)
    config = hf_pretrained_config(model_dir, hf, where)
    cls = _causal_class(config, hf, where)
    try:
        with parameters_on_meta():
            model = cls._from_config(config)
    except Exception as exc:  # a class that cannot be built from this config: say which and why
        raise UnsupportedModelError(f"{where}: transformers could not build {cls.__name__} from it: "
                                    f"{excerpt(str(exc), 300)}") from None
    _freeze_no_grad_modules(model)
    return _parts(model.eval(), cls.__name__, where)


def _forward_without_grad(module: torch.nn.Module) -> bool:
    """Whether `module`'s class runs its forward under torch.no_grad (its `@torch.no_grad()` decorator)."""
    forward = type(module).forward
    if getattr(getattr(forward, "__code__", None), "co_name", None) != "decorate_context":
        return False
    for cell in forward.__closure__ or ():
        owner = getattr(cell.cell_contents, "__self__", cell.cell_contents)
        if isinstance(owner, (torch.no_grad, torch.inference_mode)):
            return True
    return False


def _freeze_no_grad_modules(model: torch.nn.Module) -> None:
    """The parameters of modules whose forward runs without autograd (DeepSeek-V3.2's sparse-attention indexer,
    `self_attn.indexer.*`: its top-k picks the keys each query attends to) get no gradient from the loss, so
    torch.optim.AdamW never moves them in transformers: they are marked requires_grad=False here, which makes them
    frozen parameters (GenericArchitecture.frozen_parameters: read from the checkpoint, exported, no stage)."""
    for module in model.modules():
        if _forward_without_grad(module):
            for param in module.parameters():
                param.requires_grad_(False)


def _parts(model: Any, name: str, where: str) -> GenericArchitecture:
    import torch.nn as nn

    def refuse(why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{where}: {name} cannot run on the generic path: {why}")

    from transformers.conversion_mapping import extract_weight_conversions_for_model

    conversions = extract_weight_conversions_for_model(model)
    if conversions and not _conversion_read(conversions):
        raise refuse("transformers renames or reshapes its weights between the checkpoint and the modules (a "
                     "conversion mapping), while the generic path loads and saves them name for name (it undoes "
                     f"only the expert fusions of {', '.join(READ_CONVERSIONS)})")
    prefix, base = _base_model(model)
    if base is None:
        raise refuse(f"its base model is neither the module its base_model_prefix names "
                     f"({getattr(model, 'base_model_prefix', '')!r}) nor its one child model, so its decoder layers "
                     "cannot be found by name")
    embedding, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    children = dict(base.named_children())
    layer_lists = [n for n, m in children.items()
                   if isinstance(m, nn.ModuleList) and len(m) == model.config.num_hidden_layers]
    embed_names = [n for n, m in children.items() if m is embedding]
    if len(layer_lists) != 1 or len(embed_names) != 1:
        raise refuse(f"its base model ({type(base).__name__}) has no single embedding and list of "
                     f"{model.config.num_hidden_layers} decoder layers among its parts {sorted(children)}")
    tables = [n for n, m in children.items() if isinstance(m, nn.Embedding) and m is not embedding]
    if tables:  # GPT-2's wpe, Gemma 4's per-layer inputs: a second table, which the embed stage cannot hold
        what = (f"learned position embeddings ({', '.join(tables)}), a second table added to the token embedding"
                if any("pos" in n or n == "wpe" for n in tables) else
                f"a second embedding table ({', '.join(tables)}: inputs to each decoder layer looked up from the "
                "tokens)")
        raise refuse(f"it has {what}, which the generic path's embedding stage does not hold; it runs models with "
                     "one token embedding and rotary or no position embeddings")
    shared = getattr(model.config, "num_kv_shared_layers", 0)
    if isinstance(shared, int) and shared > 0:  # Gemma 4's small models
        raise refuse(f"its last {shared} decoder layers attend with the keys and values an earlier layer computed "
                     "(num_kv_shared_layers), a dependence between layers that the layer-by-layer stream does not "
                     "carry; it runs models whose layers each compute their own")
    rest = [n for n, m in children.items() if n not in (layer_lists[0], embed_names[0])
            and any(True for _ in m.parameters())]
    if not rest:  # a final norm without parameters (OLMo's): known by its class's name
        rest = [n for n, m in children.items() if "norm" in type(m).__name__.lower()]
    if len(rest) != 1:
        raise refuse(f"one final norm is expected after the layers, its base model has parameters in {rest}")
    if lm_head is not None and lm_head.weight is embedding.weight and \
            not any(True for _ in children[rest[0]].parameters()):
        raise refuse("its head stage would hold no weight (a tied LM head after a final norm without parameters)")
    heads = [n for n, m in model.named_children() if m is lm_head]
    if lm_head is None or len(heads) != 1 or not isinstance(lm_head, nn.Linear) or lm_head.bias is not None:
        raise refuse("its LM head is not one Linear without bias beside the base model")
    if [n for n, _ in embedding.named_parameters()] != ["weight"]:
        raise refuse(f"its embedding ({type(embedding).__name__}) holds more than one weight matrix")
    layers = children[layer_lists[0]]
    arch = GenericArchitecture(model, name, prefix + ".", embed_names[0], layer_lists[0], rest[0], heads[0],
                               lm_head.weight is embedding.weight)
    covered = {f"{arch.base_prefix}{arch.embed_weight_name}", arch.lm_head_weight_name}
    covered |= {f"{arch.norm_prefix}{n}" for n, _ in arch.norm.named_parameters()}
    covered |= {f"{arch.base_prefix}{arch.layers_name}.{n}" for n, _ in layers.named_parameters()}
    stray = [n for n, _ in model.named_parameters() if n not in covered]
    if stray:
        raise refuse(f"it has parameters outside the embedding, layers, final norm and LM head ({stray[0]}, ...)")
    return arch


def _base_model(model: Any) -> tuple[str, Any]:
    """(name, module) of the causal LM's base model: the child its base_model_prefix names, else its one child
    that is a transformers model (Llama 4's text model keeps it as `model` while its base_model_prefix says
    `language_model`, the name the multimodal model gives the whole causal LM); (prefix, None) when neither."""
    from transformers import PreTrainedModel

    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if base is not None and base is not model:
        return prefix, base
    children = [(n, m) for n, m in model.named_children() if isinstance(m, PreTrainedModel)]
    return children[0] if len(children) == 1 else (prefix, None)


READ_CONVERSIONS = ("qwen2_moe", "ernie4_5_moe", "phimoe", "granitemoe")
"""transformers' conversion mappings that megatrain's reader undoes (model/moe_io.py): one tensor per expert on
disk fused into [experts, ...] tensors (Qwen2-MoE's, which OLMoE shares; Ernie 4.5-MoE's, its routing bias
renamed; Phimoe's, its router renamed), GraniteMoE's renamed fused experts and router. The export writes the modules' own names, which
transformers loads as they are."""


def _conversion_read(conversions: list) -> bool:
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    ours = [repr(t) for t in conversions]
    return any(ours == [repr(t) for t in get_checkpoint_conversion_mapping(k) or []] for k in READ_CONVERSIONS)


@functools.lru_cache(maxsize=8)
def architecture(model_dir: str) -> GenericArchitecture:
    """build_architecture, once per directory and process (the planner and the trainer ask for it often).
    Read-only: the engine builds its own (model/generic_template.py changes its copy)."""
    return build_architecture(model_dir)
