"""How close a float32 result must be to its reference: bounds from rounding noise measured on the machine
that runs the test, never a constant fitted on one CPU.

MKL picks its float32 GEMM kernels by CPU (AVX-512 on Intel servers, AVX2 on AMD) and each sums in its own
order, so a float32 result moves by a CPU-dependent amount; AdamW then turns those last-bit differences into
relative differences of 1e-6 to 1e-5 in a trained tensor. A bound fitted on one machine failed on the other
(LoRA adapters at 1.89e-5 on an AVX-512 Xeon against a bound of 1e-5 fitted on an AMD EPYC).

The policy (docs/testing.md, "Tolerances"):
- Exact math is proved in float64: the engine and the reference both in float64, bound EXACT (1e-10 relative).
- A float32 comparison against an independent reference computes the same reference in float32 and in float64;
  their difference is the noise of float32 on this machine for this quantity. The engine's float32 result may
  differ from the float32 reference by at most FACTOR times that noise, and never needs to be closer than FLOOR.
  Both sides round by about the noise (measured: the engine's float32 adapters 1.1x the noise from peft's float32
  ones, 0.1x to 0.3x from the float64 ones), so FACTOR 4 leaves room for the two to round in opposite directions
  while a real fault (an adapter scaling off by 1e-3) lands 30x or more above the bound.
- A training run's noise is measured on an ensemble: the float32 reference once as it is and SAMPLES32 - 1 more
  times with its gradients perturbed by about one float32 rounding before each update (perturbed_gradients). AdamW
  amplifies a last-bit difference by an amount that varies from run to run: one LoRA adapter of a 20-step run lay
  2.7e-6 to 1.2e-5 from float64 over six such runs on an AMD EPYC (Zen 4, AVX-512) where the plain float32 run lay
  1.2e-6 from it, so one sample of the noise can sit at the low end by chance and fail a correct engine (3.7e-6
  there; the suite failed so on that machine). The largest of the ensemble is the noise.
- A failure prints the error, the measured noise and the bound together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

EXACT = 1e-10
FACTOR = 4.0
# Quantities that round less than a GEMM does (a loss averaged over many tokens) still differ by a few ulps
# when summed in another order: 16 float32 ulps.
FLOOR = 16 * torch.finfo(torch.float32).eps
# float32 runs of a training reference in the noise ensemble: the plain one and two perturbed ones.
SAMPLES32 = 3
# The perturbation's size, relative to a gradient's rms: about one float32 ulp (2^-23).
PERTURBATION = 2.0**-23

_perturbation_seed: list[int | None] = [None]


def current_perturbation() -> int | None:
    """The seed of the perturbed_gradients block being run, None outside one (tests/reference_cache.py keys on it)."""
    return _perturbation_seed[0]


@contextlib.contextmanager
def perturbed_gradients(seed: int) -> Iterator[None]:
    """Within the block, every torch.optim.AdamW step first adds to each float32 gradient PERTURBATION x its rms x
    N(0, 1) (a generator seeded by `seed`): the float32 reference run again with last-bit differences of the kind
    another summation order makes, one more sample of how far float32 strays from float64 on this run. Additive,
    in the scale of the gradient's typical element, as a sum's rounding error scales with its terms, not with the
    result: a near-zero element may change sign, which AdamW's first steps turn into a full +-lr step (a relative
    perturbation keeps every sign: measured, it left the spread of five runs at 1.16e-6 to 1.21e-6 where this gives
    2.7e-6 to 1.2e-5, around the engine's 3.7e-6). float64 gradients are left as they are."""
    original = torch.optim.AdamW.step
    generator = torch.Generator().manual_seed(seed)

    def step(self, *args, **kwargs):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None and p.grad.dtype == torch.float32 and p.grad.numel():
                        g = p.grad.double()
                        scale = PERTURBATION * g.norm() / g.numel() ** 0.5
                        noise = torch.randn(g.shape, generator=generator, dtype=torch.float64)
                        p.grad.copy_(g + scale * noise * (g != 0))  # an exact zero (no terms: a row no token used) stays
        return original(self, *args, **kwargs)

    torch.optim.AdamW.step = step
    _perturbation_seed[0] = seed
    try:
        yield
    finally:
        torch.optim.AdamW.step = original
        _perturbation_seed[0] = None


def relative_error(value, reference) -> float:
    """|value - reference| / |reference| for numbers; the norm of the difference over the norm of the reference
    for tensors (in float64, so the measurement adds no rounding of its own)."""
    if isinstance(value, torch.Tensor) or isinstance(reference, torch.Tensor):
        a, b = torch.as_tensor(value).double(), torch.as_tensor(reference).double()
        return float((a - b).norm() / b.norm()) if b.norm() > 0 else float((a - b).norm())
    return abs(value - reference) / abs(reference) if reference != 0 else abs(value - reference)


def bound(noise: float, factor: float = FACTOR, floor: float = FLOOR) -> float:
    """The largest relative error allowed where the float32 reference itself is `noise` away from float64."""
    return max(factor * noise, floor)


def assert_within_noise(what: str, value, reference32, reference64, factor: float = FACTOR,
                        floor: float = FLOOR) -> float:
    """`value` (the engine's float32 result) against the float32 reference, bounded by how far that reference is
    from its float64 twin on this machine. Returns the error."""
    noise = relative_error(reference32, reference64)
    err, limit = relative_error(value, reference32), bound(noise, factor, floor)
    assert err <= limit, (f"{what}: relative error {err:.2e} from the float32 reference, bound {limit:.2e} = "
                          f"max({factor:g} x measured noise {noise:.2e}, floor {floor:.1e}) (the float32 "
                          f"reference against float64); from the float64 reference {relative_error(value, reference64):.2e}")
    return err


def assert_all_within_noise(what: str, values: Mapping, reference32: Mapping, reference64: Mapping,
                            factor: float = FACTOR, floor: float = FLOOR, samples32: Sequence[Mapping] = ()) -> float:
    """Named results of one run (the final tensors, or each step's loss) against the float32 reference, two ways:
    - all together, as one vector, within `factor` times the noise of that vector: a fault spread over many
      results shows here (measured: an adapter scaling off by 1e-3 gives 6.6e-6 against a noise of 4.2e-7,
      where the correct run gives 5.2e-7);
    - each, within `factor` times the run's largest noise: a fault in one result shows here. One result's own
      noise is no scale: the reference may by chance round one tensor less than the engine does (measured: a
      down_proj 4.7x its own noise, 1.5x the run's largest).
    `samples32`: more float32 runs of the reference (perturbed_gradients); each noise is the largest of them all.
    Returns the worst single error."""
    assert set(values) == set(reference32) == set(reference64), set(values) ^ set(reference32)
    keys = list(values)
    ensemble = [reference32, *samples32]

    def flat(results: Mapping) -> torch.Tensor:
        return torch.cat([torch.as_tensor(results[k]).double().flatten() for k in keys])
    together = max(ensemble, key=lambda sample: relative_error(flat(sample), flat(reference64)))
    noise = relative_error(flat(together), flat(reference64))
    err, limit = relative_error(flat(values), flat(reference32)), bound(noise, factor, floor)
    assert err <= limit, (f"{what}: all {len(keys)} together: relative error {err:.2e} from the float32 reference, "
                          f"bound {limit:.2e} = max({factor:g} x measured noise {noise:.2e}, floor {floor:.1e}) (the "
                          f"float32 reference against float64, the largest of {len(ensemble)} runs); from the float64 "
                          f"reference {relative_error(flat(values), flat(reference64)):.2e}")
    noise = max(relative_error(sample[k], reference64[k]) for k in keys for sample in ensemble)
    limit = bound(noise, factor, floor)
    errors = {k: relative_error(values[k], reference32[k]) for k in keys}
    worst = max(errors, key=errors.get)
    assert errors[worst] <= limit, (
        f"{what} {worst}: relative error {errors[worst]:.2e} from the float32 reference, bound {limit:.2e} = "
        f"max({factor:g} x measured noise {noise:.2e}, floor {floor:.1e}) (the largest float32-against-float64 "
        f"error among the reference's {len(keys)}, over {len(ensemble)} runs); from the float64 reference "
        f"{relative_error(values[worst], reference64[worst]):.2e}")
    return errors[worst]


def run_noise(reference32: Mapping, reference64: Mapping, samples32: Sequence[Mapping] = ()) -> float:
    """The largest float32-against-float64 error among a run's named results (and among its ensemble's runs)."""
    return max(relative_error(sample[k], reference64[k]) for k in reference32 for sample in (reference32, *samples32))


def assert_exact(what: str, value, reference, limit: float = EXACT) -> float:
    """float64 against float64: the same math up to summation order."""
    err = relative_error(value, reference)
    assert err <= limit, f"{what}: relative error {err:.2e} in float64, bound {limit:.0e}"
    return err


def assert_run_exact(losses: Sequence[float], state: Mapping[str, torch.Tensor], ref_losses: Sequence[float],
                     ref_state: Mapping[str, torch.Tensor], initial: Mapping[str, torch.Tensor], moved: float,
                     against: str = "") -> None:
    """A float64 run against a float64 reference: every step's loss and every final tensor within EXACT (the
    same tensors on both sides, float64 kept), and every tensor moved by more than `moved` relative to
    `initial`, so the comparison proves something."""
    suffix = f" against {against}" if against else ""
    assert len(losses) == len(ref_losses), (len(losses), len(ref_losses))
    for step, (ours, ref) in enumerate(zip(losses, ref_losses)):
        assert_exact(f"loss at step {step}{suffix}", ours, ref)
    assert set(state) == set(ref_state), sorted(set(state) ^ set(ref_state))
    for name, value in state.items():
        assert value.dtype == torch.float64, f"{name} is {value.dtype}"
        assert_exact(f"{name}{suffix}", value, ref_state[name])
        change = relative_error(value, initial[name])
        assert change > moved, f"{name} barely moved ({change:.2e}): the comparison would prove nothing"


@dataclass
class Reference:
    """An independent reference run twice from the same start on the same batches: in float32 (what the engine's
    float32 run is compared with) and in float64 (what measures the float32 run's noise)."""
    losses32: list[float]
    state32: dict[str, torch.Tensor]
    losses64: list[float]
    state64: dict[str, torch.Tensor]
    samples32: list[tuple[list[float], dict[str, torch.Tensor]]] = field(default_factory=list)
    """More float32 runs with perturbed gradients (perturbed_gradients): (losses, final state) each."""

    def loss_samples(self) -> list[dict[int, float]]:
        return [dict(enumerate(losses)) for losses, _ in self.samples32]

    def state_samples(self, keys) -> list[dict[str, torch.Tensor]]:
        return [{k: state[k] for k in keys} for _, state in self.samples32]


def assert_run_within_noise(losses: Sequence[float], state: Mapping[str, torch.Tensor], ref: Reference,
                            initial: Mapping[str, torch.Tensor] | None = None, factor: float = FACTOR) -> float:
    """A float32 training run against the reference's: every step's loss within `factor` times the losses' noise,
    every final tensor within `factor` times the tensors' noise; with `initial`, every tensor must have moved by
    more than 100 times that bound, or the comparison would prove nothing. Returns the worst tensor error."""
    steps = range(len(ref.losses32))
    assert len(losses) == len(ref.losses32) == len(ref.losses64)
    assert_all_within_noise("loss at step", dict(zip(steps, losses)), dict(zip(steps, ref.losses32)),
                            dict(zip(steps, ref.losses64)), factor, samples32=ref.loss_samples())
    worst = assert_all_within_noise("final tensor", state, {k: ref.state32[k] for k in state},
                                    {k: ref.state64[k] for k in state}, factor, samples32=ref.state_samples(state))
    limit = bound(run_noise({k: ref.state32[k] for k in state}, {k: ref.state64[k] for k in state},
                            ref.state_samples(state)), factor)
    for name, value in (initial or {}).items():
        if name in state:
            moved = relative_error(state[name], value)
            assert moved > 100 * limit, (f"{name} barely moved ({moved:.2e}, bound {limit:.2e}): the comparison "
                                         "would prove nothing")
    return worst


def reference_in_both(train: Callable[[torch.dtype], tuple[list[float], dict[str, torch.Tensor]]],
                      samples32: int = SAMPLES32) -> Reference:
    """Reference from `train(dtype) -> (losses, final state)` run in float32 and in float64, and `samples32` - 1
    more times in float32 with perturbed gradients (the noise ensemble; `train` must build its model and optimizer
    afresh on each call)."""
    losses32, state32 = train(torch.float32)
    losses64, state64 = train(torch.float64)
    samples = []
    for seed in range(1, samples32):
        with perturbed_gradients(seed):
            samples.append(train(torch.float32))
    return Reference(losses32, state32, losses64, state64, samples)
