"""GRPO's chunked head (model/policy_head.py) against an independent reference: full logits of a plain float64
RMSNorm + LM head, log_softmax, the labels' log-probabilities, TRL 1.16's own GRPOTrainer._compute_loss on the
completion tokens (tests/reference_grpo.py, which also gives TRL's advantages and importance-sampling ratios), and
torch autograd back through the logits.

The head sees TRL's [rows, completion] tensors laid out as a GRPO batch: prompt + completion rows of seq_len tokens,
labels -100 on the prompt and the padding, every per-token input aligned with the labels and NaN where labels are
-100 (the head must never read there).

Tolerances (docs/testing.md): float64 on both sides, bound EXACT (1e-10 relative; measured at most 3e-13 on a loss
near 0, on-policy where the advantages nearly cancel, and 2e-15 on the gradients). TRL computes its clip-ratio shares
in float32 (ratios of small integers): ours equal them in float64 or rounded to float32, as
tests/unit/test_grpo_loss.py.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_ray.config.grpo_section import GRPOConfig
from megatrain_ray.engine.forward_only import ForwardOnlyPasses
from megatrain_ray.messages import IGNORE_INDEX, Batch, PolicyRows, PreferenceRows
from megatrain_ray.model.head import HeadSpec
from megatrain_ray.model.policy_gradient import NEGLIGIBLE_IS_WEIGHT, ZERO_FRACTION, GRPOLossSettings
from megatrain_ray.model.policy_head import policy_eval_loss, policy_loss_and_grads, policy_token_logps
from tests.numerics import assert_exact
from tests.reference_grpo import Rollout, first_reward, trl_grpo, trl_zero_fraction

pytest.importorskip("trl")

G = 3
PROMPT_LENS = [2, 4, 3, 5, 2, 3]
COMPLETION_LENS = [5, 1, 6, 3, 7, 4]
R1 = [1.0, 0.0, 0.5, 0.25, 0.25, 0.75]  # multiples of 1/8: exact in TRL's float32 rewards
N, S, T, HIDDEN, VOCAB = len(PROMPT_LENS), 12, max(COMPLETION_LENS), 16, 37
FLOAT32_SHARES = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                  "clip_ratio/high_max")


def make_inputs(seed: int = 0) -> dict:
    """The head's inputs, labels, where TRL's completion token j of row i sits (its label column) and the old,
    reference and rollout log-probability offsets."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.full((N, S), IGNORE_INDEX)
    cols = torch.zeros(N, T, dtype=torch.long)
    for i, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
        labels[i, p - 1:p - 1 + c] = torch.randint(0, VOCAB, (c,), generator=g)
        cols[i] = p - 1 + torch.arange(T).clamp(max=c - 1)  # padding reads a completion column; TRL masks it
    return {"x": torch.randn(N, S, HIDDEN, generator=g, dtype=torch.float64),
            "norm_w": 1 + 0.1 * torch.randn(HIDDEN, generator=g, dtype=torch.float64),
            "lm_w": 0.5 * torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64), "labels": labels, "cols": cols,
            "old": 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64),
            "ref": 0.4 * torch.randn(N, T, generator=g, dtype=torch.float64),
            "sampling": 0.25 * torch.randn(N, T, generator=g, dtype=torch.float64)}


def to_rows(t: torch.Tensor, inputs: dict) -> torch.Tensor:
    """TRL's [rows, completion] tensor as the batch's [rows, seq_len], NaN off the completion labels."""
    out = torch.full((N, S), float("nan"), dtype=t.dtype)
    for i, c in enumerate(COMPLETION_LENS):
        out[i, inputs["cols"][i, :c]] = t[i, :c]
    return out


def reference(inputs: dict, softcap: float, on_policy: bool, temperature: float = 1.0, **trl_settings):
    """(TRL's result, grads of x, norm weight and LM head, every label's log-probability, the rollout)."""
    leaves = [inputs[k].clone().requires_grad_(True) for k in ("x", "norm_w", "lm_w")]
    x, norm_w, lm_w = leaves
    normed = norm_w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    logits = normed @ lm_w.t()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature  # TRL's fused LM head: the sampling temperature's distribution
    all_logps = torch.log_softmax(logits, -1).gather(2, inputs["labels"].clamp(min=0)[..., None]).squeeze(2)
    completion = all_logps.gather(1, inputs["cols"])
    current = completion.detach()
    old = current if on_policy else current + inputs["old"]
    sampling = old + inputs["sampling"]
    sampling[4, 2] = float("nan")  # a token the rollout could not score
    rollout = Rollout(prompts=[f"p{i // G}" for i in range(N)], completions=[f"c{i}" for i in range(N)],
                      lengths=COMPLETION_LENS, old_logps=old, logps=current, ref_logps=current + inputs["ref"],
                      sampling_logps=sampling, reward_funcs=[first_reward], columns={"r1": R1})
    trl = trl_grpo(rollout, num_generations=G, num_iterations=1 if on_policy else 2, **trl_settings)
    grads = torch.autograd.grad(completion, leaves, trl.grad)
    return trl, grads, all_logps.detach(), rollout


def policy_rows(trl, rollout: Rollout, inputs: dict, on_policy: bool, *, loss_type="dapo", beta=0.0,
                epsilon_high=None, importance_sampling_level="token", max_completion_length=16, is_mode=None,
                is_clip_min=None, is_clip_max=3.0, temperature=1.0) -> PolicyRows:
    return PolicyRows(trl.advantages, sampling_logps=to_rows(rollout.sampling_logps, inputs),
                      old_logps=None if on_policy else to_rows(rollout.old_logps, inputs),
                      ref_logps=to_rows(rollout.ref_logps, inputs) if beta else None,
                      loss=GRPOLossSettings(loss_type=loss_type, beta=beta, epsilon_high=epsilon_high,
                                            importance_sampling_level=importance_sampling_level,
                                            max_completion_length=max_completion_length), temperature=temperature,
                      vllm_importance_sampling_correction=is_mode is not None,
                      vllm_importance_sampling_mode=is_mode or "sequence_mask",
                      vllm_importance_sampling_clip_min=is_clip_min, vllm_importance_sampling_clip_max=is_clip_max)


def check_head(chunk_tokens: int = 5, softcap: float = 0.0, on_policy: bool = False, temperature: float = 1.0,
               **settings) -> dict:
    """The head's loss, gradients, log-probabilities and metrics against the reference; returns the errors."""
    inputs = make_inputs()
    trl, grads, all_logps, rollout = reference(inputs, softcap, on_policy, temperature, **settings)
    rows = policy_rows(trl, rollout, inputs, on_policy, temperature=temperature, **settings)
    acc = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64)
    spec = HeadSpec(1e-6, False, softcap)
    head = policy_loss_and_grads(inputs["x"], inputs["norm_w"], inputs["lm_w"], inputs["labels"], rows, spec,
                                 chunk_tokens, acc)
    errors = {"loss": assert_exact("loss", head.loss_sum, trl.loss)}
    for name, ours, theirs in zip(("grad x", "grad norm weight", "grad LM head"),
                                  (head.grad_x, head.grad_norm_weight, acc), grads):
        assert theirs.abs().sum() > 0
        errors[name] = assert_exact(name, ours, theirs)
    valid = inputs["labels"] != IGNORE_INDEX
    errors["token logps"] = assert_exact("token logps", head.token_logps, torch.where(valid, all_logps, 0))
    for key, value in head.metrics.items():
        if key == ZERO_FRACTION:  # ours, from TRL's ratio
            errors[key] = assert_exact(key, value, trl_zero_fraction(trl.is_ratio, rollout.mask,
                                                                     NEGLIGIBLE_IS_WEIGHT))
            continue
        assert key in trl.metrics, f"TRL logs no {key}; it logged {sorted(trl.metrics)}"
        if key in FLOAT32_SHARES:
            assert trl.metrics[key] in (float(value), float(value.float())), (key, float(value), trl.metrics[key])
        else:
            errors[key] = assert_exact(key, value, torch.tensor(trl.metrics[key], dtype=torch.float64))
    expected = {k for k in trl.metrics if k.startswith(("clip_ratio/", "sampling/")) or k == "kl"}
    assert expected <= set(head.metrics), expected - set(head.metrics)
    return errors


@pytest.mark.parametrize("on_policy", [False, True], ids=["old_logps", "on_policy"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_head_matches_trl_through_full_logits(loss_type, beta, on_policy):
    """Chunks of 5 tokens (rows of 12 split across chunks), asymmetric clipping, with and without the KL term; the
    generating policy's log-probabilities given (num_iterations > 1) or the head's own (on-policy)."""
    check_head(on_policy=on_policy, loss_type=loss_type, beta=beta, epsilon_high=0.28)


@pytest.mark.parametrize("on_policy", [False, True], ids=["old_logps", "on_policy"])
@pytest.mark.parametrize("mode,clip_min,clip_max", [("token_truncate", None, 1.2), ("token_mask", 0.8, 1.25),
                                                    ("sequence_truncate", 0.5, 1.5), ("sequence_mask", None, 1.5)])
def test_importance_sampling_correction_matches_trl(mode, clip_min, clip_max, on_policy):
    """TRL weighs by exp(old - sampling), old being the head's own log-probabilities when on-policy."""
    errors = check_head(on_policy=on_policy, loss_type="grpo", beta=0.04, is_mode=mode, is_clip_min=clip_min,
                        is_clip_max=clip_max)
    assert "sampling/importance_sampling_ratio/mean" in errors


@pytest.mark.parametrize("chunk_tokens", [1, 7, 12, 1000])
def test_sequence_level_ratio_and_soft_capped_head_match_trl(chunk_tokens):
    """GSPO's sequence-level ratio, a soft-capped head (Gemma 2), one chunk per token up to one for the batch."""
    check_head(chunk_tokens=chunk_tokens, softcap=5.0, loss_type="bnpo", beta=0.1, epsilon_high=0.28,
               importance_sampling_level="sequence", is_mode="token_mask", is_clip_min=0.8, is_clip_max=1.25)


@pytest.mark.parametrize("softcap", [0.0, 5.0], ids=["plain", "softcap"])
def test_the_sampling_temperature_divides_the_logits_as_trls_head(softcap):
    """TRL computes GRPO's log-probabilities at the rollout's temperature (logits / T, after a soft-cap)."""
    check_head(chunk_tokens=7, softcap=softcap, temperature=0.7, loss_type="dapo", beta=0.04,
               is_mode="token_truncate", is_clip_max=1.2)


def head_of(rows: PolicyRows, inputs: dict, grad_lm_acc: torch.Tensor | None = None, cut=slice(None)):
    return policy_loss_and_grads(inputs["x"][cut], inputs["norm_w"], inputs["lm_w"], inputs["labels"][cut], rows,
                                 HeadSpec(1e-6), 5, grad_lm_acc)


def test_frozen_head_gives_the_input_gradient_only():
    """LoRA's head (grad_lm_acc None): the same loss and gradient of x, none for the weights."""
    inputs = make_inputs()
    trl, _, _, rollout = reference(inputs, 0.0, False, loss_type="dapo", beta=0.04)
    rows = policy_rows(trl, rollout, inputs, False, loss_type="dapo", beta=0.04)
    full = head_of(rows, inputs, torch.zeros(VOCAB, HIDDEN, dtype=torch.float64))
    frozen = head_of(rows, inputs)
    assert frozen.grad_norm_weight is None
    assert torch.equal(frozen.loss_sum, full.loss_sum) and torch.equal(frozen.grad_x, full.grad_x)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "bnpo"])
def test_ranks_sharing_a_step_add_up_to_the_whole_batch(loss_type):
    """Two ranks' rows (PolicyRows.select with the whole batch's totals) give the whole batch's loss, gradients and
    LM head gradient when summed."""
    inputs = make_inputs()
    settings = {"loss_type": loss_type, "beta": 0.04, "is_mode": "token_truncate", "is_clip_max": 1.2}
    trl, _, _, rollout = reference(inputs, 0.0, False, **settings)
    rows = policy_rows(trl, rollout, inputs, False, **settings)
    whole_acc, parts_acc = (torch.zeros(VOCAB, HIDDEN, dtype=torch.float64) for _ in range(2))
    whole = head_of(rows, inputs, whole_acc)
    tokens = int((inputs["labels"] != IGNORE_INDEX).sum())
    parts = [head_of(rows.select(cut, N, tokens), inputs, parts_acc, cut) for cut in (slice(0, 2), slice(2, None))]
    assert_exact("loss", sum(p.loss_sum for p in parts), whole.loss_sum)
    assert_exact("grad x", torch.cat([p.grad_x for p in parts]), whole.grad_x)
    assert_exact("grad norm weight", sum(p.grad_norm_weight for p in parts), whole.grad_norm_weight)
    assert_exact("grad LM head", parts_acc, whole_acc)
    assert_exact("kl", sum(p.metrics["kl"] for p in parts), whole.metrics["kl"])


def test_forward_only_passes_equal_the_heads():
    inputs = make_inputs()
    trl, _, _, rollout = reference(inputs, 0.0, False, loss_type="grpo", beta=0.04)
    rows = policy_rows(trl, rollout, inputs, False, loss_type="grpo", beta=0.04)
    head = head_of(rows, inputs, torch.zeros(VOCAB, HIDDEN, dtype=torch.float64))
    args = (inputs["x"], inputs["norm_w"], inputs["lm_w"], inputs["labels"])
    assert torch.equal(policy_token_logps(*args, HeadSpec(1e-6), 5), head.token_logps)
    assert torch.equal(policy_eval_loss(*args, rows, HeadSpec(1e-6), 5), head.loss_sum)


def test_rows_from_the_config_carry_its_loss_settings():
    grpo = GRPOConfig(loss_type="dr_grpo", beta=0.1, epsilon=0.1, epsilon_high=0.3,
                      importance_sampling_level="sequence", use_bias_correction_kl=False, max_completion_length=64,
                      vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_min=0.5,
                      vllm_importance_sampling_clip_max=2.0, temperature=0.6)
    rows = PolicyRows.from_config(grpo, torch.zeros(2, dtype=torch.float64), total_rows=4, total_tokens=9)
    assert rows.loss == GRPOLossSettings.of(grpo)
    assert (rows.vllm_importance_sampling_correction, rows.vllm_importance_sampling_mode,
            rows.vllm_importance_sampling_clip_min, rows.vllm_importance_sampling_clip_max) == (True, "token_mask",
                                                                                                0.5, 2.0)
    assert (rows.total_rows, rows.total_tokens, rows.temperature) == (4, 9, 0.6)


def test_inconsistent_rows_are_refused():
    inputs = make_inputs()
    adv = torch.zeros(N, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs the rollout's log-probabilities"):
        head_of(PolicyRows(adv, vllm_importance_sampling_correction=True), inputs)
    with pytest.raises(ValueError, match="old_logps is \\(6, 7\\); it must be aligned with the labels"):
        head_of(PolicyRows(adv, old_logps=torch.zeros(N, T)), inputs)
    with pytest.raises(ValueError, match="one advantage per row"):
        head_of(PolicyRows(adv[:4]), inputs)
    with pytest.raises(ValueError, match="advantages must be \\[rows\\]"):
        PolicyRows(adv, ref_logps=torch.zeros(N + 1, S))
    with pytest.raises(ValueError, match="a GRPO batch needs a native layer template"):  # model.template generic
        ForwardOnlyPasses.refuse_objective_on_generic(None, Batch(inputs["labels"], inputs["labels"],
                                                                  policy=PolicyRows(adv)))
    with pytest.raises(ValueError, match="not both"):
        Batch(inputs["labels"], inputs["labels"], preference=PreferenceRows(adv, 0.1, 0.0, "sigmoid"),
              policy=PolicyRows(adv))
