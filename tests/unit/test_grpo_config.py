"""finetune.objective=grpo: TRL's defaults, what the config refuses (one message naming the key), reward functions
resolved from `module:function`, and what `megatrain train` refuses of GRPO in this version (before anything
starts)."""

from __future__ import annotations

import dataclasses
import importlib
import textwrap

import pytest

from megatrain_ray.config.grpo_section import GRPOConfig
from megatrain_ray.config.load import load_config
from megatrain_ray.exceptions import ConfigError
from megatrain_ray.model.layout import build_layout
from megatrain_ray.model.policy_gradient import GRPOLossSettings
from tests.conftest import tiny_raw

REWARDS = "tests.reference_grpo:first_reward"


def grpo(reward_funcs=(REWARDS,), **sections):
    raw = tiny_raw(**{"data": {"batch_size": 8}, **sections})
    finetune = raw.get("finetune", {})
    raw["finetune"] = {"objective": "grpo", **finetune,
                       "grpo": {"reward_funcs": list(reward_funcs), **finetune.get("grpo", {})}}
    return load_config(raw=raw)


def test_defaults_are_trls():
    trl = pytest.importorskip("trl")
    theirs = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    shared = [f.name for f in dataclasses.fields(GRPOConfig) if f.name in theirs]
    assert len(shared) == len(dataclasses.fields(GRPOConfig)) - 2  # all but reward_funcs and max_prompt_length
    ours = GRPOConfig()
    for name in shared:
        assert getattr(ours, name) == theirs[name], name
    cfg = grpo(finetune={"grpo": {"loss_type": "dr_grpo", "beta": 0.04, "epsilon_high": 0.28,
                                  "max_completion_length": 64, "importance_sampling_level": "sequence"}})
    assert GRPOLossSettings.of(cfg.finetune.grpo) == GRPOLossSettings(
        loss_type="dr_grpo", beta=0.04, epsilon=0.2, epsilon_high=0.28, importance_sampling_level="sequence",
        use_bias_correction_kl=True, max_completion_length=64)
    assert cfg.finetune.grpo.reward_functions()[0].__name__ == "first_reward"
    assert cfg.finetune.grpo.weights == [1.0]
    assert load_config(raw=tiny_raw()).finetune.objective == "sft"


def test_scale_rewards_takes_trls_booleans():
    assert grpo(finetune={"grpo": {"scale_rewards": True}}).finetune.grpo.scale_rewards == "group"
    assert grpo(finetune={"grpo": {"scale_rewards": False}}).finetune.grpo.scale_rewards == "none"


@pytest.mark.parametrize("grpo_values,key", [
    ({"num_generations": 1}, "finetune.grpo.num_generations"),
    ({"epsilon": 1.0}, "finetune.grpo.epsilon"),
    ({"epsilon_high": 0.0}, "finetune.grpo.epsilon_high"),
    ({"beta": -0.1}, "finetune.grpo.beta"),
    ({"top_p": 0.0}, "finetune.grpo.top_p"),
    ({"top_k": -1}, "finetune.grpo.top_k"),
    ({"temperature": 0.0}, "finetune.grpo.temperature"),
    ({"num_iterations": 0}, "finetune.grpo.num_iterations"),
    ({"max_completion_length": 0}, "finetune.grpo.max_completion_length"),
    ({"max_prompt_length": 0}, "finetune.grpo.max_prompt_length"),
    ({"loss_type": "cispo"}, "finetune.grpo.loss_type"),
    ({"scale_rewards": "prompt"}, "finetune.grpo.scale_rewards"),
    ({"reward_weights": [1.0, 2.0]}, "finetune.grpo.reward_weights"),
    ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.5},
     "finetune.grpo.vllm_importance_sampling_clip_min"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
     "finetune.grpo.vllm_importance_sampling_mode"),
])
def test_refused_with_the_key_named(grpo_values, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        grpo(finetune={"grpo": grpo_values})


def test_batch_of_whole_groups_and_a_reward_function_are_required():
    with pytest.raises(ConfigError, match=r"data\.batch_size.*multiple of 8"):
        grpo(data={"batch_size": 6})
    with pytest.raises(ConfigError, match=r"finetune\.grpo\.reward_funcs.*at least one"):
        grpo(reward_funcs=())


def test_reward_functions_are_resolved_with_clear_errors(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        THRESHOLD = 3
        def length_reward(prompts, completions, **kwargs):
            return [float(len(c)) for c in completions]
        def no_kwargs(completions):
            return [0.0] * len(completions)
        async def later(prompts, completions, **kwargs):
            return [0.0] * len(completions)
        class Scorer:
            @staticmethod
            def score(prompts, completions, **kwargs):
                return [1.0] * len(completions)
    """))
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('needs an API key')\n")
    importlib.invalidate_caches()
    monkeypatch.chdir(tmp_path)  # a module in the working directory is found
    cfg = grpo(reward_funcs=["my_rewards:length_reward", "my_rewards:Scorer.score"],
               finetune={"grpo": {"reward_weights": [1.0, 0.5]}})
    fns = cfg.finetune.grpo.reward_functions()
    assert fns[0](prompts=["p"], completions=["abc"]) == [3.0] and fns[1].__name__ == "score"
    cases = [("nowhere_rewards:f", r"reward_funcs\[0\].*nowhere_rewards.*cannot be imported"),
             ("my_rewards:missing", r"reward_funcs\[0\].*has no attribute 'missing'"),
             ("my_rewards:THRESHOLD", r"reward_funcs\[0\].*'THRESHOLD' is not callable \(an int\)"),
             ("my_rewards:no_kwargs", r"reward_funcs\[0\].*keyword argument\(s\) prompts, completion_ids"),
             ("my_rewards:later", r"reward_funcs\[0\].*async"),
             ("broken_rewards:f", r"reward_funcs\[0\].*RuntimeError: needs an API key"),
             ("my_rewards.length_reward", r"reward_funcs\[0\].*expected `module:function`")]
    for spec, message in cases:
        with pytest.raises(ConfigError, match=message):
            grpo(reward_funcs=[spec])
    with pytest.raises(ConfigError, match=r"reward_funcs.*twice"):
        grpo(reward_funcs=["my_rewards:length_reward"] * 2)


@pytest.mark.parametrize("settings,message", [
    ({"data": {"batch_size": 8, "packing": True}}, r"data\.packing.*one prompt and one completion"),
])
def test_train_refuses_the_grpo_settings_this_version_does_not_run(settings, message):
    from megatrain_ray.driver.trainer import Trainer

    with pytest.raises(ConfigError, match=message):
        Trainer(grpo(**settings))


def test_a_full_fine_tunes_kl_reference_is_planned_in_host_ram():
    """beta > 0, full fine-tuning: a frozen copy of the initial weights in the streaming dtype (RunSpec.reference_copy,
    kind `reference`: one per stage, as large as the stage), which no GPU-resident layer may bypass; LoRA needs none
    (its reference is the base without adapters)."""
    from megatrain_ray.config.resolved import RunSpec
    from megatrain_ray.planning.host_memory import store_bytes

    cfg = grpo(finetune={"grpo": {"beta": 0.04}}, precision={"stream_dtype": "bfloat16", "compute_dtype": "bfloat16"})
    run = RunSpec.resolve(cfg, device_type="cpu")
    ram = store_bytes(cfg, run, 1)[0]
    assert run.reference_copy and ram["reference"] == ram["stream"] == 2 * build_layout(cfg.model).num_params
    assert "reference" not in store_bytes(grpo(), RunSpec.resolve(grpo(), device_type="cpu"), 1)[0]
    lora = grpo(finetune={"grpo": {"beta": 0.04}, "method": "lora"})
    assert not RunSpec.resolve(lora, device_type="cpu").reference_copy
    with pytest.raises(ConfigError, match=r"engine\.gpu_resident=1 needs finetune\.grpo\.beta=0"):
        RunSpec.resolve(grpo(finetune={"grpo": {"beta": 0.04}}, engine={"gpu_resident": 1}), device_type="cpu")
