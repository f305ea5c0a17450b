"""GRPO end to end through `megatrain train`'s Trainer (runtime local): prompts prepared with `--format prompts`, the
rollout engine's completions, the reward functions, the advantages and the policy-gradient head in one step; the
metrics TRL logs; a resume that continues bit-identically (the rollout's sampling included); a bad reward function is
one error naming it. The head's loss and gradients are checked against TRL's loss in tests/unit/test_grpo_head.py,
generation against transformers in tests/integration/test_rollout.py."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.exceptions import CheckpointError, RewardFunctionError  # noqa: E402
from megatrain_ray.store.checkpoint import CheckpointDir  # noqa: E402
from tests.conftest import interrupted_and_resumed, tiny_raw  # noqa: E402
from tests.integration.test_lora_parity import float64_transformers  # noqa: E402, F401  (a fixture)
from tests.numerics import assert_exact  # noqa: E402
from tests.reference_dpo import hf_token_logps  # noqa: E402
from tests.reference_grpo import Rollout, first_reward, trl_grpo  # noqa: E402
from tests.integration.test_grpo_prompts import (  # noqa: E402, F401  (fixtures)
    TEXT_RECORDS,
    run_prepare,
    tokenizer_dir,
    write_jsonl,
)

HERE = "tests.integration.test_grpo_train"


def digit_reward(prompts, completions, answer, **kwargs):
    """1 per digit of the answer the completion contains (a reward a tiny random model sometimes earns)."""
    return [sum(ch in c for ch in a) / len(a) for c, a in zip(completions, answer)]


def short_reward(prompts, completions, completion_ids, **kwargs):
    return [-len(ids) / 8 for ids in completion_ids]


def even_reward(prompts, completions, completion_ids, **kwargs):
    """The even tokens of the completion / 8: varies within a group (the advantages are not 0), exact in float32
    (TRL casts rewards to it)."""
    return [sum(i % 2 == 0 for i in ids) / 8 for ids in completion_ids]


def broken_reward(prompts, completions, **kwargs):
    raise KeyError("answer")


@pytest.fixture(scope="module")
def prompts_dir(tmp_path_factory, tokenizer_dir):  # noqa: F811
    tmp = tmp_path_factory.mktemp("grpo")
    run_prepare(tokenizer_dir, write_jsonl(tmp / "prompts.jsonl", TEXT_RECORDS * 2), tmp / "prepared")
    return tmp / "prepared"


def grpo_config(tmp_path, prompts_dir, steps: int = 3, rewards=("digit_reward", "short_reward"),
                rollout_weights: str = "auto", sections=None, model=None, **grpo):
    raw = tiny_raw(model={"vocab_size": 512, "max_position_embeddings": 256, **(model or {})}, train={"steps": steps},
                   engine={"device": "cpu", "poison_buffers": True, "rollout_weights": rollout_weights},
                   data={"path": str(prompts_dir), "seq_len": 40, "batch_size": 8, "seed": 3},
                   optimizer={"lr": 1e-2}, checkpoint={"dir": str(tmp_path / "ckpt")}, **(sections or {}))
    raw["train"]["output_dir"] = str(tmp_path / "run")
    raw["finetune"] = {**raw.get("finetune", {}), "objective": "grpo", "grpo": {"reward_funcs": [f"{HERE}:{name}" for name in rewards],
                                                     "reward_weights": [1.0, 0.5][:len(rewards)],
                                                     "num_generations": 4, "max_completion_length": 12, **grpo}}
    return load_config(raw=raw)


def test_grpo_steps_log_trl_metrics_and_move_the_weights(tmp_path, prompts_dir):
    cfg = grpo_config(tmp_path, prompts_dir)
    with Trainer(cfg) as trainer:
        before = trainer.master_weights()
        history = trainer.train()
        after = trainer.master_weights()
    assert [r["step"] for r in history] == [0, 1, 2]
    for record in history:
        for key in ("reward", "reward_std", "rewards/digit_reward/mean", "rewards/short_reward/mean",
                    "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "rollout_s",
                    "rollout_tokens_per_s", "rollout_sync_s"):
            assert key in record and math.isfinite(record[key]), key
        assert math.isfinite(record["loss"]) and 1 <= record["completions/mean_length"] <= 12
        # the advantages are normalised within each group: the reward of a group minus its mean, so the
        # weighted rewards' mean equals the per-function means weighted
        assert record["reward"] == pytest.approx(record["rewards/digit_reward/mean"] +
                                                 0.5 * record["rewards/short_reward/mean"], abs=1e-9)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in logged] == [r["reward"] for r in history]


def test_resident_rollout_weights_are_refreshed_after_each_update(tmp_path, prompts_dir):
    """The rollout's resident copy (engine.rollout_weights: resident) against streaming the stages for every token:
    the same completions, rewards and losses at every step, so the copy holds each step's updated weights."""
    runs = {}
    for weights in ("streamed", "resident"):
        with Trainer(grpo_config(tmp_path / weights, prompts_dir, rollout_weights=weights)) as trainer:
            runs[weights] = trainer.train()
    for key in ("loss", "reward", "rollout_tokens", "completions/mean_length"):
        assert [r[key] for r in runs["resident"]] == [r[key] for r in runs["streamed"]], key
    # On-policy: the rollout's log-probabilities of its tokens are the trainer's up to float32 rounding (two summation
    # orders: measured at most 9.5e-7 on an AVX-512 Xeon; the bound is 20x that). A copy left stale after the first
    # update (lr 1e-2) gives 1.4e-4 at the second step and 6e-4 at the third.
    gaps = [r["sampling/sampling_logp_difference/max"] for run in runs.values() for r in run]
    assert max(gaps) < 2e-5, gaps


KILL_IN_GENERATION = r"""
import os, signal, socket, sys
from megatrain_ray.__main__ import main
from megatrain_ray.engine.rollout import passes

config, step, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
target, calls, sample = (seed * 1_000_003 + step) % (1 << 63), [0], passes.next_tokens

def next_tokens(logits, sampling, generator):  # the driver (runtime local: the GPU worker in it) dies mid-decode
    if sampling.seed == target:
        calls[0] += 1
        if calls[0] == 3:
            prefix = f"megatrain-{socket.gethostname().replace('-', '_')}-{os.getpid()}-"
            with open(out, "w") as f:
                f.write("\n".join(n for n in os.listdir("/dev/shm") if n.startswith(prefix)))
            os.kill(os.getpid(), signal.SIGKILL)
    return sample(logits, sampling, generator)

passes.next_tokens = next_tokens
sys.exit(main(["train", config, "--local"]))
"""


def killed_in_generation(cfg, tmp_path: Path, step: int) -> list[str]:
    """`megatrain train` of `cfg` (a checkpoint after every step) in a subprocess whose driver kill -9s itself in the
    middle of step `step`'s decoding, while the checkpoint of the step before is still being written; returns the
    segments it held, once they are gone (its guardian removes them)."""
    import subprocess
    import sys
    import time

    import yaml

    from megatrain_ray.config.load import config_to_yaml
    from tests.conftest import REPO

    raw = yaml.safe_load(config_to_yaml(cfg))
    raw["checkpoint"]["every"] = 1
    path, held = tmp_path / "kill.yaml", tmp_path / "held.txt"
    path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, "-c", KILL_IN_GENERATION, str(path), str(step), str(cfg.train.seed),
                           str(held)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    segments = held.read_text().split()
    deadline = time.monotonic() + 15
    while any(os.path.exists(f"/dev/shm/{name}") for name in segments):
        assert time.monotonic() < deadline, "15 s after the kill the driver's segments are still there"
        time.sleep(0.1)
    return segments


@pytest.mark.parametrize("num_iterations,cut,beta", [(1, 2, 0.0), (2, 3, 0.1)], ids=["kill-9", "mid-group"])
def test_a_resumed_grpo_run_samples_and_trains_as_the_uninterrupted_one(tmp_path, prompts_dir, num_iterations, cut,
                                                                         beta):
    """kill-9: the driver is killed (SIGKILL) in the middle of step 2's generation, the checkpoint of step 2 still
    being written: its segments go, the half-written checkpoint is not one (the run resumes from step 1's), no
    metrics line is cut. mid-group: cut after 3 steps and resumed from the checkpoint there, inside the group of
    steps 2 and 3 of num_iterations 2 (the checkpoint keeps its batch), with beta > 0 (the reference copy made
    again from the initial weights, the checkpoint loaded over the trained ones). Either way the run ends as the
    uninterrupted one, bit for bit."""
    def read(trainer):
        return trainer.master_weights(), [json.loads(line) for line in
                                          (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]

    settings = {"num_iterations": num_iterations, "beta": beta}
    with Trainer(grpo_config(tmp_path / "straight", prompts_dir, steps=4, **settings)) as trainer:
        trainer.train()
        weights, records = read(trainer)
    cfg = grpo_config(tmp_path / "cut", prompts_dir, steps=4, **settings)
    if num_iterations == 1:
        assert killed_in_generation(cfg, tmp_path, cut)  # it held segments, and they went
        lines = (tmp_path / "cut" / "run" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [0, 1]  # whole lines only
        assert [c.step for c in CheckpointDir(tmp_path / "cut" / "ckpt").complete()] == [1]
        with Trainer(cfg, resume="auto") as trainer:
            resumed_at = trainer.next_step
            trainer.train()
            weights2, records2 = read(trainer)
        cut = 1
    else:
        resumed_at, (weights2, records2) = interrupted_and_resumed(cfg, stop_after=cut, every=cut, read=read)
    assert resumed_at == cut
    assert [r["loss"] for r in records2] == [r["loss"] for r in records]
    for key in ("reward", "completions/mean_length", "rollout_tokens", *(("kl",) if beta else ())):
        assert [r.get(key) for r in records2] == [r.get(key) for r in records], key
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)
    if num_iterations > 1:
        assert [("reward" in r) for r in records] == [True, False, True, False]
        inside = next(c for c in CheckpointDir(tmp_path / "cut" / "ckpt").complete() if c.step == 3)
        (inside.directory / "grpo-rollout.pt").unlink()  # a resume there cannot train step 3 on step 2's batch
        with pytest.raises(CheckpointError, match=r"grpo-rollout\.pt.*cannot be read.*multiple of "
                                                  r"finetune\.grpo\.num_iterations=2"):
            Trainer(cfg, resume=str(inside.directory))


def test_a_reward_function_that_raises_is_named(tmp_path, prompts_dir):
    cfg = grpo_config(tmp_path, prompts_dir, rewards=("broken_reward",))
    with Trainer(cfg) as trainer, pytest.raises(RewardFunctionError, match="'broken_reward' raised KeyError"):
        trainer.train()


def completion_rows(t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Label-aligned [rows, seq_len] values as TRL's [rows, longest completion] (zero padded)."""
    valid = labels != -100
    out = torch.zeros(labels.shape[0], int(valid.sum(1).max()), dtype=torch.float64)
    for i in range(labels.shape[0]):
        values = t[i][valid[i]]
        out[i, :len(values)] = values
    return out


@pytest.mark.parametrize("method", ["full", "lora"])
def test_kl_to_the_initial_model_and_a_reused_batch_match_trl(tmp_path, prompts_dir, method,
                                                              float64_transformers):  # noqa: F811
    """beta > 0 and num_iterations = 2, float64: a batch is generated at steps 0 and 2 and trained on twice. The
    reference log-probabilities the driver puts in the batch at step 2 are those of the initial model (transformers
    with the weights before training; LoRA: the base without adapters), after two updates moved the policy; step
    0's KL is 0 (the policy is the reference), step 2's is the k3 mean of the math; and step 3, on step 2's batch
    with its old log-probabilities, logs TRL 1.16's loss on the same numbers (_compute_loss, vLLM importance
    sampling on, as finetune.grpo's defaults)."""
    sections = {"precision": {"master_dtype": "float64", "compute_dtype": "float64"}}
    if method == "lora":
        sections["finetune"] = {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}}
    beta = 0.1
    cfg = grpo_config(tmp_path, prompts_dir, steps=4, rewards=("even_reward",), sections=sections, beta=beta,
                      num_iterations=2)
    m = cfg.model
    with torch.random.fork_rng():  # transformers' initialisation, seeded: the same weights every run
        torch.manual_seed(11)
        reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.num_key_value_heads, max_position_embeddings=m.max_position_embeddings,
            rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, tie_word_embeddings=m.tie_word_embeddings,
            attn_implementation="sdpa")).to(torch.float64).eval()
    generated, scored, records = [], [], []
    with Trainer(cfg) as trainer:
        names = trainer.master_weights()
        # transformers' own random initialisation as the weights before training (LoRA: the base), reference copy too
        trainer.load_weights({k: v for k, v in reference.state_dict().items() if k in names})
        steps = trainer.rollouts
        batch, score = steps.batch, steps.score
        steps.batch = lambda step, gpu: generated.append(batch(step, gpu)) or generated[-1]
        steps.score = lambda rows, ids: scored.append(score(rows, ids)) or scored[-1]
        for step in range(3):
            records.append(trainer.step(step))
            trainer.next_step = step + 1
        rows = generated[1].batch
        current = trainer.gpu.token_logps(rows).result()  # the policy after 3 updates
        records.append(trainer.step(3))
    assert len(generated) == 2 and "reward" in records[2] and "reward" not in records[3]
    labels, policy = rows.labels, rows.policy
    with torch.no_grad():
        ref = hf_token_logps(reference, rows.input_ids, labels)
    assert_exact("the reference pass against the initial model", policy.ref_logps, ref)
    assert records[0]["kl"] == 0.0 and records[2]["kl"] > 1e-6
    valid = labels != -100
    d = (ref - policy.old_logps)[valid]
    assert_exact("step 2's KL", records[2]["kl"], float((torch.exp(d) - d - 1).mean()))
    lengths = valid.sum(1).tolist()
    old = completion_rows(policy.old_logps, labels)
    rollout = Rollout(prompts=[f"p{i // 4}" for i in range(len(lengths))], completions=[""] * len(lengths),
                      lengths=lengths, old_logps=old, logps=completion_rows(current, labels),
                      ref_logps=completion_rows(ref, labels), sampling_logps=completion_rows(policy.sampling_logps,
                                                                                             labels),
                      reward_funcs=[first_reward], columns={"r1": scored[1][0][:, 0].tolist()})
    trl = trl_grpo(rollout, num_generations=4, beta=beta, max_completion_length=12, is_mode="sequence_mask")
    assert_exact("advantages", policy.advantages, trl.advantages)
    assert_exact("step 3's loss", records[3]["loss"], float(trl.loss))
    assert_exact("step 3's KL", records[3]["kl"], trl.metrics["kl"])
