"""What the generic path checks when it loads a directory, for the frontier families (tests/integration/
test_generic_moe.py trains them): Gemma 4's layers that need more than their input refused naming the key, and a
multi-token-prediction layer the model class skips on load skipped as transformers skips it."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.integration.test_generic_template import VOCAB, generic_config, save  # noqa: E402


def test_a_multi_token_prediction_layer_is_skipped_as_transformers_skips_it(tmp_path):
    """GLM-4.5-Air's hub directory holds its 46 layers and a multi-token-prediction layer `model.layers.46.*`, which
    Glm4MoeForCausalLM skips on load (_keys_to_ignore_on_load_unexpected): a 46-layer GLM-4.5 MoE directory with such
    a layer passes the check before loading, as transformers loads it with no unexpected key; a tensor of a layer
    the class does not skip (`model.layers.47.*`) is still refused."""
    from safetensors.torch import load_file, save_file

    from megatrain_ray.config.generic_shape import generic_model_config
    from megatrain_ray.exceptions import CheckpointError
    from megatrain_ray.model.hf_io import HFDirectory
    from megatrain_ray.model.layout import build_layout

    config = transformers.Glm4MoeConfig(vocab_size=VOCAB, hidden_size=36, intermediate_size=44,
                                        moe_intermediate_size=20, num_attention_heads=6, num_key_value_heads=2,
                                        head_dim=8, n_routed_experts=6, n_shared_experts=1, num_experts_per_tok=3,
                                        first_k_dense_replace=1, num_hidden_layers=46, max_position_embeddings=64)
    source = save(transformers.Glm4MoeForCausalLM(config), tmp_path / "hf")
    weights = load_file(source / "model.safetensors")
    mtp = {"model.layers.46.eh_proj.weight": torch.zeros(36, 72), "model.layers.46.enorm.weight": torch.ones(36)}
    for e in range(6):  # its experts one tensor each, as the layers' own on disk
        mtp |= {f"model.layers.46.mlp.experts.{e}.{n}.weight": torch.zeros(shape)
                for n, shape in (("gate_proj", (20, 36)), ("up_proj", (20, 36)), ("down_proj", (36, 20)))}
    save_file({**weights, **mtp}, source / "model.safetensors", metadata={"format": "pt"})
    _, info = transformers.AutoModelForCausalLM.from_pretrained(source, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    layout = build_layout(generic_model_config(source))
    HFDirectory(source).check_against_layout(layout)
    save_file({**weights, **mtp, "model.layers.47.enorm.weight": torch.ones(36)}, source / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"holds 1 tensor\(s\) the model of its config.json does not have, "
                       r"first 'model.layers.47.enorm.weight'"):
        HFDirectory(source).check_against_layout(layout)


@pytest.mark.parametrize("kind", ["per_layer_inputs", "kv_shared_layers"])
def test_gemma4_layers_that_need_more_than_their_input_are_refused_in_words(tmp_path, kind):
    """Gemma 4's small models feed each layer a slice of a second embedding table (hidden_size_per_layer_input)
    or let their last layers attend with an earlier layer's keys and values (num_kv_shared_layers): refused on load,
    naming the class and the key, where the forward's probe could only fail with a TypeError."""
    from megatrain_ray.config.hf import UnsupportedArchitectureError

    extra = ({"hidden_size_per_layer_input": 4} if kind == "per_layer_inputs" else
             {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 1, "num_hidden_layers": 3,
              "layer_types": ["sliding_attention", "full_attention", "full_attention"]})
    config = transformers.Gemma4TextConfig(**{"vocab_size": VOCAB, "num_hidden_layers": 2, "hidden_size": 36,
                                              "intermediate_size": 44, "num_attention_heads": 6,
                                              "num_key_value_heads": 2, "head_dim": 6, "global_head_dim": 10,
                                              "sliding_window": 8, **extra})
    source = save(transformers.Gemma4ForCausalLM(config), tmp_path / "hf")
    why = (r"it has a second embedding table \(embed_tokens_per_layer" if kind == "per_layer_inputs" else
           r"its last 1 decoder layers attend with the keys and values an earlier layer computed "
           r"\(num_kv_shared_layers\)")
    with pytest.raises(UnsupportedArchitectureError, match=r"Gemma4ForCausalLM cannot run on the generic path: "
                       + why):
        generic_config(tmp_path, source)
