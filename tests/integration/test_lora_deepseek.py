"""LoRA on DeepSeek-V3 and GLM-4.5 MoE (finetune.method=lora) against transformers + peft, in float64.

Where peft 0.21.2 puts the adapters on transformers 5.23's DeepseekV3ForCausalLM and Glm4MoeForCausalLM
(config/lora_targets.py): the attention's nn.Linear projections (DeepSeek-V3's latent attention: q_a_proj, q_b_proj
or one q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; GLM's q/k/v/o_proj with their frozen biases), the router
`mlp.gate.weight` and every routed expert of the fused tensors (peft maps both families as Qwen3-MoE: gate_up_proj at
rank 2r, down_proj at r); the shared experts and the dense first layers' MLPs get none under any name, as in peft.
The routing bias stays as loaded (a buffer in transformers, FIXED_TENSORS here).

The tiny models of tests/reference_deepseek.py (hidden 72, 3 heads with q.k width 20 and value width 14, a 24-wide
latent, 10 experts in 2 groups, top-3, 2 shared experts, a dense first layer), saved with save_pretrained and loaded
by both sides. The reference is peft's model on tests/reference_deepseek.float64_deepseek's copy (its RoPE tables,
RMSNorms and router in float64 where transformers keeps them float32), trained by torch.optim.AdamW with
clip_grad_norm_ and the run's schedule (tests/integration/test_lora_parity.train_peft). Both sides then compute the
same math up to summation order: every step's loss and every final adapter within 1e-10 (tests/numerics.EXACT),
each adapter moved by more than 1e-2 (B starts at zero), 8 steps at lr 1e-2. Measured (pytest -s) by the parameters.
The Ray path adds nothing of these families' own (the templates run the same in an actor): the qwen3_moe LoRA
run through Ray stands for it (tests/integration/test_lora_moe_parity.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.exceptions import ConfigError  # noqa: E402
from tests.conftest import learnable_tokens, one_thread, tiny_raw  # noqa: E402
from tests.integration.test_lora_parity import train_peft  # noqa: E402
from tests.numerics import assert_run_exact, assert_within_noise, bound, relative_error  # noqa: E402
from tests.reference_deepseek import float64_deepseek, hf_deepseek_model  # noqa: E402

STEPS = 8
LATENT = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def lora_run_config(tmp_path: Path, base: Path, targets, steps: int = STEPS, **sections):
    defaults = {"finetune": {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": targets}},
                "train": {"steps": steps, "output_dir": str(tmp_path / "run")}, "optimizer": {"lr": 1e-2},
                "data": {"seq_len": 24, "batch_size": 2},
                "precision": {"master_dtype": "float64", "compute_dtype": "float64"}}
    raw = tiny_raw(**{key: {**defaults.get(key, {}), **sections.get(key, {})} for key in {*defaults, *sections}})
    raw["model"] = {"path": str(base)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", 128)
    return load_config(raw=raw)


def peft_reference(model, cfg, targets, initial: dict[str, torch.Tensor]):
    """peft's LoRA model on the float64 reference copy of `model`, with megatrain's initial adapters (every key
    matched)."""
    lora = cfg.finetune.lora
    ref = peft.get_peft_model(float64_deepseek(model), peft.LoraConfig(
        r=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=0.0, target_modules=targets, bias="none",
        task_type="CAUSAL_LM"))
    result = peft.set_peft_model_state_dict(ref, initial)
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if "lora_" in k], result.missing_keys
    return ref


def run_both(tmp_path: Path, name: str, targets, **sections):
    model = hf_deepseek_model(name)
    model.save_pretrained(tmp_path / "base")
    cfg = lora_run_config(tmp_path, tmp_path / "base", targets, **sections)
    with Trainer(cfg) as trainer:
        initial = trainer.adapters()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
        final = trainer.adapters()
        base_after = trainer.master_weights()
    with one_thread():
        ref_losses, ref_final = train_peft(peft_reference(model, cfg, targets, initial), cfg, batches)
    return model, ours, initial, final, ref_losses, ref_final, base_after


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_q_proj", "glm4_moe"])
@pytest.mark.parametrize("targets", ["all-linear", ["gate_proj", "up_proj"], ["down_proj", "o_proj"], ["gate"]])
def test_adapters_have_peft_keys_and_shapes(name, targets):
    """megatrain's adapters are exactly peft's on the transformers model, key for key and shape for shape (the MLA
    projections the model has, the router's mlp.gate, the experts' mlp.experts / mlp.experts.base_layer; none on
    the shared experts or the dense first layer)."""
    from megatrain_ray.config.hf import model_config_from_hf
    from megatrain_ray.model.lora import initial_adapters, peft_name

    model = hf_deepseek_model(name)
    cfg = load_config(raw=tiny_raw(model=dataclasses.asdict(model_config_from_hf(model.config.to_dict())),
                                   finetune={"method": "lora", "lora": {"r": 4, "lora_alpha": 8,
                                                                        "target_modules": targets}}))
    ours = {peft_name(i, n): tuple(t.shape) for i in range(cfg.model.num_layers)
            for n, t in initial_adapters(cfg.model, cfg.finetune.lora, 0, i).items()}
    theirs = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    assert ours == {k: tuple(v.shape) for k, v in peft.get_peft_model_state_dict(theirs).items()}


@pytest.mark.parametrize("name, targets, adapted", [
    # Measured (pytest -s, an AMD EPYC): losses / adapters within 1.8e-16 / 8.2e-15, 1.8e-16 / 2.8e-15, 3.7e-16 /
    # 3.6e-15; without kv_b_proj's adapter in the template the backward finds it unused (fails).
    # the low-rank query, interleaved RoPE: 5 latent projections a layer, the router and experts on the 2 MoE layers
    ("deepseek_v3", "all-linear", 3 * 5 + 2 * 3),
    # one q_proj, RoPE by halves; the experts alone (gate_proj + up_proj fused at rank 2r, down_proj) and kv_b_proj
    ("deepseek_v3_q_proj", ["kv_b_proj", "gate_proj", "up_proj", "down_proj"], 2 * 1 + 1 * 2),
    # GLM-4.5 MoE: GQA with qkv biases and q/k norms; its four projections and the router
    ("glm4_moe", ["q_proj", "k_proj", "v_proj", "o_proj", "gate"], 3 * 4 + 2 * 1),
])
def test_deepseek_lora_float64_matches_peft(tmp_path, name, targets, adapted):
    model, ours, initial, final, ref_losses, ref_final, base_after = run_both(tmp_path, name, targets)
    assert len(final) == 2 * adapted, sorted(final)
    assert not [k for k in final if "shared_experts" in k or ".layers.0.mlp." in k]
    assert_run_exact(ours, final, ref_losses, ref_final, initial, moved=1e-2, against="peft")
    worst = max(relative_error(v, ref_final[k]) for k, v in final.items())
    print(f"{name}: losses within {max(relative_error(a, b) for a, b in zip(ours, ref_losses)):.2e}, adapters "
          f"{worst:.2e}")
    for key, value in model.state_dict().items():  # the frozen base, routing biases included, as loaded
        assert torch.equal(base_after[key], value.to(base_after[key].dtype)), key


@pytest.mark.float32_parity
def test_deepseek_lora_export_loads_in_peft_with_the_same_logits(tmp_path):
    """train.export_dir (float32, the GPU's default precision): adapter_config.json and adapter_model.safetensors
    load with PeftModel.from_pretrained on the Hugging Face base with no missing or unexpected key (nor a warning of
    either), target_parameters and the fused experts' rank pattern as peft writes them; that model's float32 logits
    and the merged export's (loaded by transformers alone) are megatrain's within 4x the noise of their float64 twins
    (tests/numerics.assert_within_noise). Measured by the prints."""
    import warnings

    model = hf_deepseek_model("deepseek_v3")
    model.save_pretrained(tmp_path / "base")
    cfg = lora_run_config(tmp_path, tmp_path / "base", "all-linear", steps=4,
                          precision={"master_dtype": "float32", "compute_dtype": "float32"},
                          train={"export_dir": str(tmp_path / "export")})
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with Trainer(cfg) as trainer:
        trainer.train()
        ours = trainer.logits(ids)
        adapters = trainer.adapters()
    adapter_dir = tmp_path / "export" / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(LATENT)
    assert sorted(config["target_parameters"]) == ["down_proj", "gate.weight", "gate_up_proj"]
    assert set(peft.utils.load_peft_weights(str(adapter_dir))) == set(adapters)

    def hf(directory: Path):
        return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                 experts_implementation="eager").eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = peft.PeftModel.from_pretrained(hf(tmp_path / "base"), adapter_dir).eval()
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    merged = hf(tmp_path / "export" / "merged")
    with torch.no_grad(), one_thread():
        theirs, theirs64 = loaded(ids).logits, float64_deepseek(loaded.base_model.model)(ids).logits
        merged32, merged64 = merged(ids).logits, float64_deepseek(merged)(ids).logits
        plain = model.eval()(ids).logits
    err = assert_within_noise("logits of peft's model on the export", ours, theirs, theirs64)
    merged_err = assert_within_noise("logits of the merged export", ours, merged32, merged64)
    moved = relative_error(ours, plain)
    assert moved > 100 * bound(relative_error(theirs, theirs64))  # the adapters change the logits
    print(f"export: peft's logits within {err:.2e}, the merged model's {merged_err:.2e}; the adapters moved them "
          f"{moved:.2e}")


@pytest.mark.parametrize("rank, target", [(40, "q_proj"), (0, "q_a_proj")])
def test_a_query_projection_the_model_has_not_is_refused(tmp_path, rank, target):
    model = hf_deepseek_model("deepseek_v3" if rank else "deepseek_v3_q_proj")
    model.save_pretrained(tmp_path / "base")
    with pytest.raises(ConfigError, match=f"'{target}' is not a projection of this model's latent attention"):
        lora_run_config(tmp_path, tmp_path / "base", [target, "o_proj"])


def test_the_shared_experts_are_refused_as_peft_cannot_adapt_them(tmp_path):
    model = hf_deepseek_model("deepseek_v3")
    model.save_pretrained(tmp_path / "base")
    with pytest.raises(ConfigError, match="shared experts and the dense first layers' MLPs take no adapter"):
        lora_run_config(tmp_path, tmp_path / "base", ["shared_experts"])


@pytest.mark.parametrize("weights", ["streamed", "resident"])
def test_lora_rollout_rows_equal_peft_generate(tmp_path, weights):
    """The rollout through the LoRA engine on DeepSeek-V3 (all-linear: every latent projection's adapter, kv_b_proj's
    merged into the compressed cache's head maps, the router's and the experts'), the adapters' B drawn non-zero:
    greedy rows of a left-padded batch equal peft's generate of each prompt alone in float64 (up to a near tie of
    its two best logits), their log-probabilities within 2 float32 roundings of peft's; the adapters change what is
    generated. `weights`: the base streamed, or every layer GPU-resident (engine.gpu_resident all). Measured: the
    log-probabilities within 3.7e-8 (the float32 storage); with kv_b_proj's adapter left out of the head maps the
    first token already differs (fails)."""
    from megatrain_ray.engine.rollout.interface import SamplingSettings
    from tests.integration.test_grpo_step import nonzero_adapters
    from tests.integration.test_rollout import NEW, assert_greedy_row, prompts_for
    from tests.integration.test_rollout_deepseek import assert_logps

    model = hf_deepseek_model("deepseek_v3")
    model.save_pretrained(tmp_path / "base")
    resident = {"gpu_resident": "all", "rollout_weights": "resident"} if weights == "resident" else \
        {"rollout_weights": "streamed"}
    cfg = lora_run_config(tmp_path, tmp_path / "base", "all-linear", steps=4, engine=resident)
    prompts = prompts_for(128)
    with Trainer(cfg) as trainer:
        adapters = nonzero_adapters(trainer)
        ours = trainer.gpu.generate(prompts, SamplingSettings(max_new_tokens=NEW, temperature=0)).result()
    assert ours.stats["weights_resident"] == float(weights == "resident")
    ref = peft_reference(model, cfg, "all-linear", adapters).eval()
    plain = float64_deepseek(model)
    with one_thread():
        for row, prompt in enumerate(prompts):
            assert_greedy_row(ours.tokens[row], ref, prompt, f"row {row}")
        print(f"{weights}: log-probabilities within {assert_logps(ours, ref, prompts):.2e}")
        with torch.no_grad():
            base_only = plain.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(prompts[0]):]
    assert not torch.equal(ours.tokens[0], base_only)  # the adapters change what is generated
