"""Training parity of the mixture-of-experts templates against transformers' MoE models themselves.

The tiny random MoE models of tests/unit/test_moe.py (hidden 72, GQA 4/2, several experts, top-k 2 or 4)
are trained for 20 steps by megatrain and by the Hugging Face model with torch.optim.AdamW (matrices and
the fused [E, ...] expert tensors decayed, vectors not, as megatrain's layout does), clip_grad_norm_ and
the same warmup + cosine schedule, on the same rows of 24 tokens, as tests/integration/test_phi3_parity.py
does. With the load-balancing loss on (output_router_logits, router_aux_loss_coef 0.02, larger than the
hub's 0.001 so that it moves the weights measurably) the reference's loss is its cross-entropy plus
coef * the aux_loss transformers returns. lr 1e-3 (gpt-oss 3e-3, see LR).

Tolerances (tests/numerics.py), per-step loss and each final tensor (norm of the difference over the norm);
pytest -s prints the measurements (an AVX-512 Xeon's below):
- float64 (float64_bound): the reference float64 throughout (tests/reference_hf.float64_throughout: RoPE tables,
  RMSNorms and the attention's softmax in float64, where transformers computes them in float32 even in a float64
  model; megatrain computes them in float64). Without the load-balancing loss, 1e-10 (EXACT): the same math up
  to summation order (measured: weights within 8.3e-15, losses 3.7e-16). With it, a fixed 1e-5: transformers
  sums the routers' probabilities in float32 whatever the dtype, megatrain as transformers but per layer and
  chunk, in another order, and AdamW amplifies those float32 roundings (measured 4.3e-8 to 6.6e-8 in the
  weights). gpt-oss, fixed 1e-5: its attention with sinks has no SDPA path in transformers, so its softmax stays
  float32 (as megatrain's), and its YaRN tables are left as transformers computes them (megatrain follows its
  float32 ramp); measured 4.9e-7 to 2.4e-6 in the weights, losses within 2.7e-8. All three are roundings of
  softmaxes, sums and tables, not of GEMMs: no CPU moves them by orders of magnitude. Was 1e-5 for all, with
  transformers' float32 steps left in (measured 5e-7 to 2.7e-6).
- float32 (the Ray runs of Qwen3-MoE without the aux loss and of Mixtral; the others in float64, see
  RAY_FLOAT64): transformers' run is made twice from the same weights on the same batches, in float32 and in
  float64 (float64 throughout); megatrain's float32 run must be within 4x the reference's largest
  float32-against-float64 difference (floor 16 float32 ulps, 1.9e-6), and all its tensors together within 4x
  their noise together, measured on the machine running the test: MKL's float32 GEMMs round by CPU, so the old
  fixed 1e-5 held on one CPU only. Measured: tensors 1.5e-6 to 2.8e-6 against noises of 2.0e-6 to 3.7e-6
  (bounds 7.9e-6 to 1.5e-5); all together 2.1e-7 to 2.9e-7 and losses within 2.1e-7, against the floor.
- logits of a round trip through transformers (the same float32 weights, forward only): within 4x the
  float32-against-float64 difference of transformers' logits, floor 16 float32 ulps (was 1e-5 absolute).
  Measured 1.1e-7 to 1.5e-7 against noises of 1.6e-7 to 2.0e-7: the bound is the floor.
A weight of the reference scaled by 1 + 1e-3 fails every one of these tests, float64 and float32, the round trips
too.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from megatrain_ray.config.hf import model_config_from_hf  # noqa: E402
from megatrain_ray.driver.trainer import Trainer  # noqa: E402
from tests.conftest import one_thread, tiny_config, train_from_hf_weights  # noqa: E402
from tests.integration.test_phi3_parity import assert_float32_parity, assert_float64_run  # noqa: E402
from tests.numerics import EXACT, assert_within_noise, reference_in_both, relative_error  # noqa: E402
from tests.reference_cache import ReferenceRuns  # noqa: E402
from tests.reference_hf import train_export_and_reload, train_hf  # noqa: E402
from tests.unit.test_moe import hf_moe_model  # noqa: E402

AUX_COEF = 0.02
# gpt-oss's tiny model (its SwiGLU clamped at 0.6) learns too slowly at 1e-3 for the loss to fall measurably
# over 20 steps: 3e-3 there. Not more: at 2e-2 with the aux loss on, a top-k choice between two nearly equal
# router logits flips between the runs (transformers' float32 RoPE tables against megatrain's float64 ones
# differ by 1e-8) and the weights part by 6e-3; routing is discrete, so such a flip is no bug.
LR = {"gpt-oss": 3e-3}
# Ray runs compared in float64 (against the reference float64 throughout, bounds as float64_bound), not float32:
# - gpt-oss: at 3e-3 its float32 runs differ by 1.3e-5 (float32 noise amplified by AdamW, as the float32 Phi-3
#   runs without clipping);
# - Qwen3-MoE with the load-balancing loss: megatrain's float32 error from transformers' float32 run measured 4.0x
#   to 7.6x the reference's float32-against-float64 noise on an AVX-512 Xeon (error 5.3e-6 to 7.1e-6, noise 6.9e-7
#   to 1.8e-6 depending on the reference's thread count: one tensor's noise in one run is a single sample of a
#   chaotic quantity), so no 4x bound holds it reliably; without the aux loss the ratio is 0.8x, and Mixtral
#   covers float32 with the aux loss (0.7x).
RAY_FLOAT64 = {("gpt-oss", True), ("gpt-oss", False), ("qwen3-moe-dense-layer", True)}
# transformers' runs, each made once (the local float64 test's serves the Ray run's and the float64 twin of a float32
# Ray run): tests/reference_cache.py.
REFERENCES = ReferenceRuns()


def run_both(tmp_path, name: str, dtype: str, aux: bool, **sections):
    """The same 20 steps through megatrain and through the transformers model; returns (our losses, its
    losses, our final weights, its, the initial weights, our step records)."""
    model = hf_moe_model(name, output_router_logits=aux, router_aux_loss_coef=AUX_COEF)
    return _run_model(tmp_path, model, name, dtype, **sections)


def _run_engine(tmp_path, model, name: str, dtype: str, **sections):
    """The 20 steps through megatrain; returns (cfg, our step records, the initial weights, the batches, our
    final weights)."""
    aux = bool(model.config.output_router_logits)
    mcfg = model_config_from_hf(model.config.to_dict())
    assert mcfg.output_router_logits == aux
    precision = {"master_dtype": dtype, "compute_dtype": dtype}
    sections["optimizer"] = {"lr": LR.get(name, 1e-3), **sections.get("optimizer", {})}
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": 24}, precision=precision,
                      **sections)
    initial, batches, records, final = train_from_hf_weights(cfg, model)
    tied = {"lm_head.weight"} if mcfg.tie_word_embeddings else set()
    assert set(initial) == set(model.state_dict()) - tied  # transformers 5's names, experts fused
    assert all(("aux_loss" in r) == aux for r in records)
    return cfg, records, initial, batches, final


def _run_model(tmp_path, model, name: str, dtype: str, **sections):
    """megatrain and transformers in `dtype`: a float64 reference float64 throughout except gpt-oss (see
    float64_bound)."""
    cfg, records, initial, batches, final = _run_engine(tmp_path, model, name, dtype, **sections)
    ref_losses, ref_state = train_hf(model, cfg, initial, batches, getattr(torch, dtype),
                                     bool(model.config.output_router_logits), exact=name != "gpt-oss", runs=REFERENCES)
    return [r["loss"] for r in records], ref_losses, final, ref_state, initial, records


def float64_bound(name: str, aux: bool) -> float:
    """EXACT where both sides are float64 but for summation order; else the fixed 1e-5 of the module docstring."""
    return EXACT if not aux and name != "gpt-oss" else 1e-5


def assert_float64_parity(name: str, aux: bool, ours, ref, final, ref_state, initial, records) -> None:
    assert_float64_run(ours, ref, final, ref_state, initial, limit=float64_bound(name, aux))
    assert all(("aux_loss" in r) == aux for r in records)


@pytest.mark.parametrize("aux", [True, False], ids=["aux", "noaux"])
@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "qwen3-moe-sparse-step", "mixtral-sliding", "gpt-oss"])
def test_moe_float64_matches_transformers(tmp_path, name, aux):
    assert_float64_parity(name, aux, *run_both(tmp_path, name, "float64", aux, optimizer={"workers": 2}))


RAY_CASES = [pytest.param(name, aux, marks=() if (name, aux) in RAY_FLOAT64 else pytest.mark.float32_parity,
                           id=f"{name}-{'aux' if aux else 'noaux'}")
             for name in ("qwen3-moe-dense-layer", "mixtral-sliding", "gpt-oss") for aux in (True, False)]


@pytest.mark.ray
@pytest.mark.parametrize("name,aux", RAY_CASES)
def test_moe_ray_matches_transformers(tmp_path, ray_session, name, aux):
    """The Ray path: host shards, GPU worker and 2 optimizer workers as actors. float32 within the measured noise,
    or float64 (RAY_FLOAT64)."""
    sections = {"optimizer": {"workers": 2}, "runtime": {"mode": "ray"}}
    if (name, aux) in RAY_FLOAT64:
        assert_float64_parity(name, aux, *run_both(tmp_path, name, "float64", aux, **sections))
        return
    model = hf_moe_model(name, output_router_logits=aux, router_aux_loss_coef=AUX_COEF)
    cfg, records, initial, batches, final = _run_engine(tmp_path, model, name, "float32", **sections)
    reference = reference_in_both(lambda dtype: train_hf(model, cfg, initial, batches, dtype, aux, exact=True,
                                                         runs=REFERENCES))
    assert_float32_parity([r["loss"] for r in records], final, initial, reference)


def _fused_directory(model, out) -> None:
    """`model` written with transformers 5's in-memory names (experts fused), as gpt-oss's save_pretrained writes."""
    from safetensors.torch import save_file

    out.mkdir()
    model.config.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.float32_parity
@pytest.mark.parametrize("name,on_disk", [("qwen3-moe-dense-layer", "per-expert"), ("qwen3-moe-sparse-step", "fused"),
                                          ("mixtral-sliding", "per-expert"), ("gpt-oss", "fused")])
def test_moe_hf_round_trip(tmp_path, name, on_disk):
    """Import a tiny HF directory (as save_pretrained writes it: Qwen3-MoE and Mixtral one tensor per expert,
    Mixtral under block_sparse_moe with w1/w3/w2; or fused), train 4 steps, export, load in transformers:
    no missing or unexpected keys, logits as megatrain's within the float32 noise of transformers' own (its
    float32 logits against float64 ones of the same weights)."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.model.hf_io import HFDirectory
    from tests.conftest import learnable_tokens, tiny_raw

    model = hf_moe_model(name)
    source = tmp_path / "source"
    if on_disk == "fused":
        _fused_directory(model, source)
    else:
        model.save_pretrained(source)
    disk_names = set(HFDirectory(source).on_disk)
    expert_key = "block_sparse_moe.experts.0.w1.weight" if name.startswith("mixtral") else "mlp.experts.0.gate_proj.weight"
    assert any(n.endswith(expert_key) for n in disk_names) == (on_disk == "per-expert")
    raw = tiny_raw(model={"path": str(source)}, data={"seq_len": 24}, train={"steps": 4, "output_dir": str(tmp_path / "run")},
                   optimizer={"lr": 1e-2})
    raw["model"] = {"path": str(source)}
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", model.config.vocab_size)
    ids = torch.randint(0, model.config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(4))
    ours, loaded = train_export_and_reload(load_config(raw=raw), model, ids, tmp_path / "hf")
    with torch.no_grad(), one_thread():
        theirs = loaded.eval()(ids).logits
        theirs64 = loaded.double()(ids).logits
    err = assert_within_noise("logits", ours, theirs, theirs64)
    print(f"logits: relative error {err:.2e}, noise (transformers' float32 against float64) "
          f"{relative_error(theirs, theirs64):.2e}")


@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "gpt-oss"])
def test_moe_chunked_mlp_and_offloaded_inputs_match_transformers(tmp_path, name):
    """The MLP in chunks of 20 tokens (96 a step: five chunks, the last short), each chunk's router record
    and aux gradient apart, layer inputs through host memory; float64, aux loss on, against transformers."""
    assert_float64_parity(name, True, *run_both(tmp_path, name, "float64", True, optimizer={"workers": 2},
                                                engine={"activation_offload": True, "mlp_chunk_tokens": 20}))


@pytest.mark.ray
@pytest.mark.parametrize("aux", [True, False], ids=["aux", "noaux"])
def test_moe_two_gpu_workers_equal_one(tmp_path, ray_session, aux):
    """Data parallel (2 ranks, each half the rows; gloo on the CPU) equals one rank for Qwen3-MoE in float64:
    each rank's expert gradients (zero for its experts without tokens) are summed like any other, and the
    load-balancing loss takes the expert counts and probabilities summed over the ranks (the whole batch's).
    1e-12 relative without it; with it 1e-6: its probability sums are float32 (as transformers computes them),
    summed per rank and then over the ranks, in another order than one rank's. Measured over 8 steps at lr 1e-2:
    3.2e-9 in the loss, 4.9e-15 in the weights (the gradient takes the exact counts, not the sums)."""
    from tests.integration.test_data_parallel import run_steps

    model = hf_moe_model("qwen3-moe-dense-layer", output_router_logits=aux, router_aux_loss_coef=AUX_COEF)
    mcfg = dataclasses.asdict(model_config_from_hf(model.config.to_dict()))
    common = dict(model=mcfg, data={"seq_len": 24}, train={"steps": 8},
                  precision={"master_dtype": "float64", "compute_dtype": "float64"}, optimizer={"lr": 1e-2})
    ref_losses, initial, ref_final = run_steps(tiny_config(tmp_path / "one", **common), 8)
    with Trainer(tiny_config(tmp_path / "two", parallel={"gpus": 2}, runtime={"mode": "ray"}, **common)) as trainer:
        records = [trainer.step(s) for s in range(8)]
        losses, final = [r["loss"] for r in records], trainer.master_weights()
    assert all(("aux_loss" in r) == aux for r in records)
    rel = 1e-6 if aux else 1e-12
    print(f"max relative loss difference {max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)):.2e}, weights "
          f"{max(((final[k] - r).norm() / r.norm()).item() for k, r in ref_final.items()):.2e}")
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= rel * abs(b), f"step {step}: loss {a!r} vs one rank's {b!r}"
    for name, ref in ref_final.items():
        assert ((final[name] - ref).norm() / ref.norm()).item() <= rel, name
        assert ((ref - initial[name]).norm() / initial[name].norm()).item() > 1e-4, f"{name} did not move"


def test_moe_gpu_resident_layers_match_transformers(tmp_path):
    """engine.gpu_resident 2: Qwen3-MoE's first two layers (a MoE and the dense one) stay on the device and
    update there, with the aux loss on; float64 against transformers."""
    assert_float64_parity("qwen3-moe-dense-layer", True, *run_both(tmp_path, "qwen3-moe-dense-layer", "float64", True,
                                                                   optimizer={"workers": 2},
                                                                   engine={"gpu_resident": 2}))


@pytest.mark.parametrize("name", ["qwen3-moe-dense-layer", "mixtral-sliding", "gpt-oss"])
def test_moe_bf16_compute_tracks_float32_transformers(tmp_path, name):
    """bfloat16 weights and math (the GPU default) on the CPU, aux loss on: every step's loss within 2 % of
    transformers' float32 run (as test_training_parity's bf16 test), and the loss falls."""
    model = hf_moe_model(name, output_router_logits=True, router_aux_loss_coef=AUX_COEF)
    mcfg = model_config_from_hf(model.config.to_dict())
    cfg = tiny_config(tmp_path, model=dataclasses.asdict(mcfg), data={"seq_len": 24},
                      precision={"compute_dtype": "bfloat16"}, optimizer={"lr": LR.get(name, 1e-3)})
    with Trainer(cfg) as trainer:
        trainer.load_weights({k: v for k, v in model.state_dict().items() if k in trainer.master_weights()})
        initial = trainer.master_weights()
        batches = [trainer.data.tokens_of(s) for s in range(cfg.train.steps)]
        ours = [trainer.step(s)["loss"] for s in range(cfg.train.steps)]
    ref, _ = train_hf(model, cfg, initial, batches, torch.float32, aux=True)
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert abs(a - b) <= 0.02 * abs(b), f"step {step}: bf16 loss {a} vs float32 reference {b}"
    assert ours[-1] < ours[0] - 0.05


@pytest.mark.parametrize("aux", [True, False], ids=["aux", "noaux"])
def test_experts_without_tokens_copy_no_gradient_and_match_transformers(tmp_path, aux):
    """gpt-oss with expert 5's router bias at -12 in every layer: it never gets a token, its fused gradient
    span is zero, and the engine copies none of it to the host (zeroed there before the update), so each
    step's D2H is at least that span short of the whole stages'. The expert still takes its AdamW step
    (weight decay on a zero gradient) as transformers 5's fused parameter does: float64 parity over 20 steps."""
    from megatrain_ray.model.layout import build_layout

    model = hf_moe_model("gpt-oss", output_router_logits=aux, router_aux_loss_coef=AUX_COEF)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias[5] = -12.0  # far below the others (about 0.1): never in the top 4
    ours, ref, final, ref_state, initial, records = _run_model(tmp_path, model, "gpt-oss", "float64",
                                                               optimizer={"workers": 2})
    assert_float64_parity("gpt-oss", aux, ours, ref, final, ref_state, initial, records)
    layout = build_layout(model_config_from_hf(model.config.to_dict()))
    idle = sum(s.numel // 6 for s in layout.layers[0].slots if s.name.startswith("mlp.experts."))
    whole = sum(stage.numel for stage in layout.stages) * 8
    assert all(r["d2h_bytes"] <= whole - len(layout.layers) * idle * 8 for r in records)
    for i in range(len(layout.layers)):  # trained: the idle expert moved by weight decay alone, as in transformers
        key = f"model.layers.{i}.mlp.experts.down_proj"
        torch.testing.assert_close(final[key][5], ref_state[key][5], rtol=1e-9, atol=0)
