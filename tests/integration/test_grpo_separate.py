"""GRPO with its rollout on a worker of its own (rl.rollout: separate, actors/rollout_worker.py; on the CPU here, as
on a second GPU there), on-policy and one step ahead (rl.async_steps: 1), against the colocated rollout:

- on-policy, the separate worker's completions and the training are the colocated run's bit for bit (full fine-tuning
  and LoRA), so the worker takes each update's weights before it generates;
- one step ahead, every step's batch and loss are those of an independent replay on the colocated trainer that
  generates batch k from the weights after k-1 updates (batches 0 and 1 from the initial ones), the documented
  schedule; through Ray (its placement group with a bundle for the worker, 2 optimizer workers) the same run again;
- a checkpoint inside the run keeps the batch generated ahead: the resumed run ends as the uninterrupted one;
- settings that cannot work are one ConfigError naming the key."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from megatrain_ray.config.load import load_config  # noqa: E402
from megatrain_ray.driver.grpo import GRPOSteps  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from megatrain_ray.exceptions import ConfigError  # noqa: E402
from tests.conftest import interrupted_and_resumed  # noqa: E402
from tests.integration.test_grpo_prompts import tokenizer_dir  # noqa: E402, F401  (a fixture)
from tests.integration.test_grpo_train import grpo_config, prompts_dir  # noqa: E402, F401  (a fixture)

LORA = {"finetune": {"method": "lora", "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}},
        "optimizer": {"lr": 5e-2}}


def with_sections(cfg, sections: dict):
    """`cfg` with `sections` merged in, key by key (a nested mapping into the key's own)."""
    raw = cfg.to_dict()
    for name, values in sections.items():
        for key, value in values.items():
            raw[name][key] = {**raw[name][key], **value} if isinstance(value, dict) else value
    return load_config(raw=raw)


def rl_config(tmp_path, prompts_dir, rollout="separate", async_steps=0, steps=3, extra=None, **grpo):  # noqa: F811
    sections = {"rl": {"rollout": rollout, "async_steps": async_steps}, **(extra or {})}
    # even_reward varies within a group, so the advantages and the updates are not 0
    return with_sections(grpo_config(tmp_path, prompts_dir, steps=steps, rewards=("even_reward",), **grpo), sections)


def recording(monkeypatch) -> list:
    """Every scored batch GRPOSteps builds, in order: (step, its rows' ids, the rollout's log-probabilities)."""
    seen, finish = [], GRPOSteps.finish

    def record(self, launched, gpu):
        out = finish(self, launched, gpu)
        seen.append((launched.step, out.batch.input_ids.clone(), out.batch.policy.sampling_logps.clone()))
        return out
    monkeypatch.setattr(GRPOSteps, "finish", record)
    return seen


@pytest.mark.parametrize("method", ["full", "lora"])
def test_the_separate_rollout_trains_as_the_colocated_one(tmp_path, prompts_dir, method, monkeypatch):  # noqa: F811
    """Full fine-tuning with each stage's update slowed by 0.1 s: a sync that did not wait for the trainer's updates
    (Trainer.step's flush) would copy weights half updated, and the completions would differ."""
    extra = LORA if method == "lora" else None
    if method == "full":
        import time

        from actors.optimizer_worker import OptimizerWorker
        apply = OptimizerWorker.apply
        monkeypatch.setattr(OptimizerWorker, "apply", lambda self, order: (time.sleep(0.1), apply(self, order))[1])
    runs = {}
    for rollout in ("colocated", "separate"):
        with Trainer(rl_config(tmp_path / rollout, prompts_dir, rollout=rollout, extra=extra)) as trainer:
            assert (trainer.cluster.rollout is not None) == (rollout == "separate")
            runs[rollout] = (trainer.train(), trainer.master_weights(),
                             trainer.gpu.adapters().result() if method == "lora" else {})
    (colocated, w1, a1), (separate, w2, a2) = runs["colocated"], runs["separate"]
    for key in ("loss", "reward", "rollout_tokens", "completions/mean_length", "sampling/sampling_logp_difference/max"):
        assert [r[key] for r in separate] == [r[key] for r in colocated], key
    assert all(torch.equal(w1[k], w2[k]) for k in w1) and all(torch.equal(a1[k], a2[k]) for k in a1)
    if method == "lora":  # the adapters moved (B starts at 0), so a stale rollout would sample from other weights
        assert any(bool(a1[k].any()) for k in a1 if "lora_B" in k)
    # on-policy at every step: the rollout's log-probabilities of its tokens are the trainer's to float32 rounding;
    # a rollout one update stale is off by about 1e-4 (lr 1e-2, test_grpo_train)
    assert max(r["sampling/sampling_logp_difference/max"] for r in separate) < 2e-5
    assert all(r["rollout_sync_s"] >= 0 and r["rollout_sync_gb"] > 0 for r in separate)


def replay_one_step_ahead(cfg, steps: int) -> tuple[list, list[dict], dict]:
    """The schedule rl.async_steps=1 promises, replayed on the colocated trainer: batch k generated (on the trainer's
    own engine) from the weights after max(k - 1, 0) updates, trained at step k."""
    colocated = with_sections(cfg, {"rl": {"rollout": "colocated", "async_steps": 0},
                                    "train": {"output_dir": cfg.train.output_dir + "-replay"},
                                    "checkpoint": {"dir": cfg.checkpoint.dir + "-replay"}})
    batches, records = {}, []
    with Trainer(colocated) as trainer:
        grpo = trainer.rollouts
        batches[0], batches[1] = grpo.batch(0, trainer.gpu), grpo.batch(1, trainer.gpu)
        grpo.step_batch = lambda step, gpu, worker=None: batches[step]
        for step in range(steps):
            records.append(trainer.step(step))
            trainer.next_step = step + 1
            trainer.flush()
            if step + 2 < steps:
                batches[step + 2] = grpo.batch(step + 2, trainer.gpu)
        return [batches[k] for k in range(steps)], records, trainer.master_weights()


def test_one_step_ahead_trains_batch_k_from_the_weights_of_k_minus_1(tmp_path, prompts_dir, monkeypatch):  # noqa: F811
    steps = 4  # evaluated after steps 1 and 3, on the rollout worker: the weights after every step taken
    cfg = rl_config(tmp_path / "ahead", prompts_dir, async_steps=1, steps=steps,
                    extra={"train": {"eval_every": 2, "eval_batches": 1}, "data": {"eval_path": str(prompts_dir)}})
    seen = recording(monkeypatch)
    with Trainer(cfg) as trainer:
        history = trainer.train()
        weights = trainer.master_weights()
    monkeypatch.undo()
    expected, records, weights_ref = replay_one_step_ahead(cfg, steps)
    assert [s for s, _, _ in seen] == list(range(steps))
    for (step, ids, logps), batch in zip(seen, expected):
        assert torch.equal(ids, batch.batch.input_ids), step
        assert torch.equal(logps, batch.batch.policy.sampling_logps), step
    assert [r["loss"] for r in history] == [r["loss"] for r in records]
    assert [r.get("eval_reward") for r in history] == [r.get("eval_reward") for r in records]
    assert "eval_reward" in history[1] and "eval_reward" in history[3]
    assert all(torch.equal(weights[k], weights_ref[k]) for k in weights)
    # off by one update from step 1 on: the trainer's log-probabilities of the sampled tokens move away from the
    # rollout's (lr 1e-2), which the importance-sampling correction weighs; at step 0 they agree to float32 rounding
    gaps = [r["sampling/sampling_logp_difference/max"] for r in history]
    assert gaps[0] < 2e-5 and min(gaps[2:]) > 10 * gaps[0], gaps
    assert all("rollout_wait_s" in r for r in history[1:]) and "rollout_wait_s" not in history[0]


def test_one_step_ahead_through_ray_with_two_optimizer_workers(tmp_path, prompts_dir):  # noqa: F811
    steps = 3
    results = {}
    for mode in ("local", "ray"):
        extra = {"runtime": {"mode": mode, "dashboard": False}, "optimizer": {"lr": 1e-2, "workers": 2}}
        with Trainer(rl_config(tmp_path / mode, prompts_dir, async_steps=1, steps=steps, extra=extra)) as trainer:
            if mode == "ray":
                assert "rollout" in trainer.actor_names
            results[mode] = ([r["loss"] for r in trainer.train()], trainer.master_weights())
    assert results["ray"][0] == results["local"][0]
    assert all(torch.equal(results["ray"][1][k], results["local"][1][k]) for k in results["local"][1])


def test_a_resumed_one_step_ahead_run_ends_as_the_uninterrupted_one(tmp_path, prompts_dir):  # noqa: F811
    def read(trainer):
        return trainer.master_weights(), [json.loads(line) for line in
                                          (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]

    with Trainer(rl_config(tmp_path / "straight", prompts_dir, async_steps=1, steps=4)) as trainer:
        trainer.train()
        weights, records = read(trainer)
    cfg = rl_config(tmp_path / "cut", prompts_dir, async_steps=1, steps=4)
    resumed_at, (weights2, records2) = interrupted_and_resumed(cfg, stop_after=2, every=2, read=read)
    assert resumed_at == 2
    for key in ("loss", "reward", "rollout_tokens", "sampling/sampling_logp_difference/max"):
        assert [r[key] for r in records2] == [r[key] for r in records], key
    assert all(torch.equal(weights[k], weights2[k]) for k in weights)


@pytest.mark.parametrize("sections,match", [
    ({"rl": {"async_steps": 1}}, r"rl\.async_steps.*rl\.rollout: separate"),
    ({"rl": {"rollout": "separate", "async_steps": 2}}, r"rl\.async_steps.*must be 0"),
    ({"rl": {"rollout": "separate", "async_steps": 1},
      "finetune": {"grpo": {"vllm_importance_sampling_correction": False}}},
     r"vllm_importance_sampling_correction.*rl\.async_steps=1"),
    ({"rl": {"rollout": "separate", "async_steps": 1}, "finetune": {"grpo": {"num_iterations": 2}}},
     r"num_iterations.*rl\.async_steps=1"),
    ({"rl": {"rollout": "separate"}, "engine": {"rollout_weights": "streamed"}}, r"engine\.rollout_weights"),
    ({"rl": {"rollout": "separate"}, "engine": {"gpu_resident": 1}}, r"gpu_resident=1 needs rl\.rollout=colocated"),
])
def test_settings_a_separate_rollout_cannot_take_are_refused(tmp_path, prompts_dir, sections, match):  # noqa: F811
    with pytest.raises(ConfigError, match=match):
        Trainer(with_sections(grpo_config(tmp_path, prompts_dir), sections))


def test_a_separate_rollout_needs_grpo(tmp_path):
    from tests.conftest import tiny_raw

    with pytest.raises(ConfigError, match=r"rl\.rollout.*finetune\.objective is 'sft'"):
        load_config(raw=tiny_raw(rl={"rollout": "separate"}))


@pytest.mark.parametrize("gpus,error", [(2, None), (1, r"rl\.rollout=separate.*need a node with 2 GPUs.*has 1")])
def test_the_rollout_worker_needs_a_gpu_beside_the_trainers(tmp_path, prompts_dir, monkeypatch, gpus,  # noqa: F811
                                                          error):
    """On a Ray cluster with GPUs, parallel.gpus auto leaves one for the rollout worker; a node with one GPU only is
    one clear error (the cluster's answers faked: this machine has no GPU)."""
    import ray

    from megatrain_ray.driver.parallel import resolve_parallel

    node = {"NodeID": "n0", "Alive": True, "Resources": {"GPU": float(gpus)}, "NodeManagerAddress": "127.0.0.1"}
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"GPU": float(gpus), "CPU": 16.0})
    monkeypatch.setattr(ray, "nodes", lambda: [node])
    cfg = rl_config(tmp_path, prompts_dir, extra={"runtime": {"mode": "ray"}, "engine": {"device": "auto"},
                                                  "parallel": {"gpus": "auto"}})
    if error is None:
        plan = resolve_parallel(cfg)
        assert (plan.world, plan.use_gpu) == (1, True)
    else:
        with pytest.raises(ConfigError, match=error):
            resolve_parallel(cfg)
