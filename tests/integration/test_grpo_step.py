"""One GRPO training step through the streamed engine (runtime.mode local, float64), full fine-tuning and LoRA,
against a plain transformers (+ peft) float64 model trained on the same batch: its log-probabilities of the
completion tokens, TRL 1.16's own GRPOTrainer._compute_loss on them (tests/reference_grpo.py: off-policy old
log-probabilities, the KL term, the rollout's importance-sampling correction), torch autograd, clip_grad_norm_ and
torch.optim.AdamW.

AdamW's first step is lr * g / (|g| + eps): with the usual eps it is about lr * sign(g) and would hide a gradient's
scale, so eps = 1 here makes the update follow the gradient; the weights' changes (final - initial) are compared, and
the gradient norm directly. The engine's forward-only token_logps (the driver's old or reference log-probabilities)
and the step's token_logps are checked against the reference's log-probabilities.

Tolerances (docs/testing.md): float64 on both sides (the reference's RoPE and RMSNorms too: float64_transformers),
bound EXACT (1e-10 relative); measured at most 2e-13 on the weight changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("trl")

from megatrain_ray.config.load import load_config
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.messages import IGNORE_INDEX, Batch, GRPOLossSettings, PolicyRows
from tests.conftest import learnable_tokens, tiny_raw
from tests.integration.test_lora_parity import float64_transformers, make_base, peft_model  # noqa: F401 - a fixture
from tests.numerics import EXACT, assert_exact, relative_error
from tests.reference_dpo import hf_token_logps
from tests.reference_grpo import Rollout, first_reward, trl_grpo

G = 2
PROMPT_LENS = [3, 5, 4, 6]
COMPLETION_LENS = [8, 4, 10, 6]
R1 = [1.0, 0.0, 0.25, 0.75]
N, S, T = len(PROMPT_LENS), 16, max(COMPLETION_LENS)
LR, CLIP = 1e-2, 1.0
SETTINGS = {"loss_type": "grpo", "beta": 0.04, "epsilon_high": 0.28, "max_completion_length": 16}
IS = {"is_mode": "token_truncate", "is_clip_min": 0.5, "is_clip_max": 1.2}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base(tmp_path_factory.mktemp("grpo") / "base", "llama")


def grpo_batch_tokens() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, labels, where TRL's completion token j of row i sits among the labels): prompt + completion rows,
    right-padded; each label the next token where that is a completion token."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(1, 96, (N, S), generator=g)
    labels = torch.full((N, S), IGNORE_INDEX)
    cols = torch.zeros(N, T, dtype=torch.long)
    for i, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
        ids[i, p + c:] = 0
        labels[i, p - 1:p - 1 + c] = ids[i, p:p + c]
        cols[i] = p - 1 + torch.arange(T).clamp(max=c - 1)
    return ids, labels, cols


def to_rows(t: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    out = torch.full((N, S), float("nan"), dtype=t.dtype)
    for i, c in enumerate(COMPLETION_LENS):
        out[i, cols[i, :c]] = t[i, :c]
    return out


def reference_step(model, ids: torch.Tensor, labels: torch.Tensor, cols: torch.Tensor):
    """One step of the transformers model: (TRL's result, the rollout, the labels' log-probabilities before it, the
    gradient norm)."""
    params = [p for p in model.parameters() if p.requires_grad]
    logps = hf_token_logps(model, ids, labels)
    completion = logps.gather(1, cols)
    current = completion.detach()
    g = torch.Generator().manual_seed(6)

    def noise(scale: float) -> torch.Tensor:
        return scale * torch.randn(N, T, generator=g, dtype=torch.float64)

    old = current + noise(0.3)
    rollout = Rollout(prompts=[f"p{i // G}" for i in range(N)], completions=[f"c{i}" for i in range(N)],
                      lengths=COMPLETION_LENS, old_logps=old, logps=current, ref_logps=current + noise(0.4),
                      sampling_logps=old + noise(0.25), reward_funcs=[first_reward], columns={"r1": R1})
    trl = trl_grpo(rollout, num_generations=G, num_iterations=2, **SETTINGS, **IS)
    torch.autograd.backward(completion, trl.grad)
    norm = torch.nn.utils.clip_grad_norm_(params, CLIP)
    torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1.0, weight_decay=0.0, foreach=False).step()
    return trl, rollout, logps.detach(), float(norm)


def policy_batch(trl, rollout: Rollout, ids: torch.Tensor, labels: torch.Tensor, cols: torch.Tensor) -> Batch:
    rows = PolicyRows(trl.advantages, sampling_logps=to_rows(rollout.sampling_logps, cols),
                      old_logps=to_rows(rollout.old_logps, cols), ref_logps=to_rows(rollout.ref_logps, cols),
                      loss=GRPOLossSettings(**SETTINGS), vllm_importance_sampling_correction=True,
                      vllm_importance_sampling_mode=IS["is_mode"], vllm_importance_sampling_clip_min=IS["is_clip_min"],
                      vllm_importance_sampling_clip_max=IS["is_clip_max"])
    return Batch(ids, labels, policy=rows)


def grpo_config(tmp_path: Path, base: Path, **sections):
    raw = tiny_raw(precision={"master_dtype": "float64", "compute_dtype": "float64"},
                   optimizer={"lr": LR, "eps": 1.0, "weight_decay": 0.0, "grad_clip": CLIP},
                   engine={"loss_chunk_tokens": 7, **sections.pop("engine", {})}, train={"steps": 1},
                   schedule={"kind": "constant", "warmup_steps": 0}, **sections)
    raw["model"] = {"path": str(base)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", 96)
    raw["train"]["output_dir"] = str(tmp_path / "run")
    return load_config(raw=raw)


def check_step(result, trl, logps: torch.Tensor, before: torch.Tensor, norm: float) -> None:
    assert_exact("loss", result.loss, float(trl.loss))
    assert_exact("gradient norm", result.grad_norm, norm)
    assert_exact("forward-only token_logps", before, logps)
    assert_exact("the step's token_logps", result.token_logps, logps)
    assert result.objective_metrics is not None
    for key in ("kl", "sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/max"):
        assert_exact(key, result.objective_metrics[key], trl.metrics[key])


def assert_changes_exact(final: dict, initial: dict, ref_final: dict, ref_initial: dict) -> None:
    assert set(final) == set(ref_final), set(final) ^ set(ref_final)
    for name, value in final.items():
        change, ref_change = value - initial[name], ref_final[name] - ref_initial[name]
        assert ref_change.abs().sum() > 0, f"{name} did not move"
        assert_exact(f"{name} change", change, ref_change)


def test_full_fine_tuning_step_matches_transformers_and_trl(tmp_path, base, float64_transformers):  # noqa: F811
    ids, labels, cols = grpo_batch_tokens()
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, attn_implementation="sdpa")
    ref_initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trl, rollout, logps, norm = reference_step(model, ids, labels, cols)
    batch = policy_batch(trl, rollout, ids, labels, cols)
    with Trainer(grpo_config(tmp_path, base)) as trainer:
        initial = trainer.master_weights()
        before = trainer.gpu.token_logps(batch).result()
        result = trainer.gpu.train_step(batch, LR, 1, batch.loss_tokens).result()
        final = trainer.master_weights()
    assert relative_error(initial["lm_head.weight"], ref_initial["lm_head.weight"]) == 0
    check_step(result, trl, logps, before, norm)
    assert_changes_exact(final, initial, model.state_dict(), ref_initial)


def test_lora_step_matches_peft_and_trl(tmp_path, base, float64_transformers):  # noqa: F811
    """all-linear adapters with B drawn non-zero (else A gets no gradient at the first step); the LM head frozen."""
    ids, labels, cols = grpo_batch_tokens()
    lora = {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}
    cfg = grpo_config(tmp_path, base, finetune=lora)
    with Trainer(cfg) as trainer:
        g = torch.Generator().manual_seed(7)
        initial = {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) if "lora_B" in k else v
                   for k, v in trainer.adapters().items()}
        trainer.set_adapters(initial)
        model = peft_model(base, cfg, initial, torch.float64)
        trl, rollout, logps, norm = reference_step(model, ids, labels, cols)
        batch = policy_batch(trl, rollout, ids, labels, cols)
        before = trainer.gpu.token_logps(batch).result()
        result = trainer.gpu.train_step(batch, LR, 1, batch.loss_tokens).result()
        final = trainer.adapters()
    check_step(result, trl, logps, before, norm)
    assert_changes_exact(final, initial, peft.get_peft_model_state_dict(model), initial)


LORA = {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}
PROMPTS = [[5, 9, 3, 17, 2], [40, 41, 7], [88, 1, 23, 54, 9, 11, 3]]


def lora_trainer_config(tmp_path: Path, base: Path, mode: str):
    """`mode`: streamed (the base streamed), adapters or merged (every layer GPU-resident, engine.rollout_lora)."""
    import json

    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    engine = {"gpu_resident": "none"} if mode == "streamed" else {"gpu_resident": layers, "rollout_lora": mode}
    return grpo_config(tmp_path, base, finetune=LORA, engine=engine)


def nonzero_adapters(trainer) -> dict:
    g = torch.Generator().manual_seed(7)
    adapters = {k: v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype) if "lora_B" in k else v
                for k, v in trainer.adapters().items()}
    trainer.set_adapters(adapters)
    return adapters


def resident_base(trainer) -> dict[int, torch.Tensor]:
    """The resident layers' device buffers, copied (runtime.mode local: the worker object is in this process)."""
    return {i: t.clone() for i, (_, t) in trainer.gpu.instance.engine.base.stages.items()}


@pytest.mark.parametrize("mode", ["streamed", "adapters", "merged"])
def test_lora_rollout_rows_equal_peft_generate(tmp_path, base, float64_transformers, mode):  # noqa: F811
    """The rollout engine through the LoRA engine (the adapters bound as in training with the base streamed or every
    layer GPU-resident, engine/rollout/weights.ResidentBaseView; or, resident, folded into the base for the
    generation, MergedBaseView): greedy rows of a left-padded batch equal peft's generate of each prompt alone,
    float64; the merged base is copied back bit for bit."""
    from megatrain_ray.engine.rollout.interface import SamplingSettings

    cfg = lora_trainer_config(tmp_path, base, mode)
    with Trainer(cfg) as trainer:
        adapters = nonzero_adapters(trainer)
        before = resident_base(trainer)
        ours = trainer.gpu.generate(PROMPTS, SamplingSettings(max_new_tokens=10, temperature=0)).result()
        assert ours.stats["weights_resident"] == float(mode != "streamed")
        assert ours.stats["lora_merged"] == float(mode == "merged")
        after = resident_base(trainer)
        assert (len(before) > 0) == (mode != "streamed") and before.keys() == after.keys()
        assert all(torch.equal(before[i], after[i]) for i in before)
        plain = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    model = peft_model(base, cfg, adapters, torch.float64)
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS):
            theirs = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(prompt):]
            base_only = plain.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                       pad_token_id=0)[0, len(prompt):]
            assert ours.tokens[row].tolist() == theirs.tolist(), f"row {row}"
            assert not torch.equal(theirs, base_only) or row > 0  # the adapters change what is generated


def test_merged_lora_rollout_logps_equal_the_trainers_and_the_base_survives_a_failure(tmp_path, base, monkeypatch):
    """engine.rollout_lora merged, float64: the sampled rows' rollout log-probabilities equal those the trainer
    recomputes with the adapters apart (token_logps) within float64 rounding; a generation that fails after the
    merge leaves the resident base bit-identical to the host's (copied back), and the failure reaches the caller."""
    import megatrain_ray.engine.rollout.passes as passes
    from megatrain_ray.driver.grpo import policy_batch as rollout_batch
    from megatrain_ray.engine.rollout.interface import SamplingSettings

    cfg = lora_trainer_config(tmp_path, base, "merged")
    with Trainer(cfg) as trainer:
        nonzero_adapters(trainer)
        before = resident_base(trainer)
        ours = trainer.gpu.generate(PROMPTS, SamplingSettings(max_new_tokens=6, temperature=1.0, seed=3)).result()
        assert ours.stats["lora_merged"] == 1.0
        advantages = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
        batch = rollout_batch(PROMPTS, ours.completions(), ours.logps, advantages, cfg.finetune.grpo, 0)
        recomputed = trainer.gpu.token_logps(batch).result()
        # the rollout returns float32 log-probabilities: equal to the recomputed float64 ones within float64 rounding
        # and one rounding to float32 (half its epsilon, relative)
        half_ulp = torch.finfo(torch.float32).eps / 2
        for row, n in enumerate(ours.lengths.tolist()):
            start = len(PROMPTS[row]) - 1  # the label of the row's first completion token
            theirs = recomputed[row, start:start + n]
            gap = (ours.logps[row, :n].double() - theirs).abs()
            assert n > 0 and bool((gap <= (half_ulp + EXACT) * theirs.abs()).all()), f"row {row}: {gap.max()}"

        def fail(*args, **kwargs):
            raise RuntimeError("sampling failed")

        monkeypatch.setattr(passes, "next_tokens", fail)
        with pytest.raises(RuntimeError, match="sampling failed"):
            trainer.gpu.generate(PROMPTS, SamplingSettings(max_new_tokens=6, temperature=0)).result()
        after = resident_base(trainer)
        assert all(torch.equal(before[i], after[i]) for i in before)
