"""Data parallel: several GPU workers (ranks) through Ray on the CPU (gloo), against one worker with the
same global batch.

The ranks sum each stage's gradients before the optimizer sees them, and each divides its loss by the
loss tokens of the whole batch, so a run on N ranks is the one-rank run up to summation order: each
rank sums its rows' gradients, then the ranks' sums are added. That is proved in float64 (tests/numerics.py):
losses and weights within 1e-10 relative (measured at most 8e-16 over 20 steps, clipping on or off; rank 0's
gradients weighted 1 + 1e-3: 1.1e-6). A fixed float32 bound (1e-6, fitted on one CPU) is no proof on another:
MKL's float32 GEMMs round by CPU. The one float32 comparison left, gradients through a float32 streaming copy,
is bounded by the one-rank run's own float32 noise, measured against the same run in float64.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import yaml

from benchmarks.update_trace import load as load_trace
from megatrain_ray.__main__ import main
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.exceptions import ConfigError, ParallelError
from megatrain_ray.store.checkpoint import CheckpointDir
from tests.conftest import REPO, learnable_tokens, tiny_config, tiny_raw
from tests.integration.test_runtime import LOOPBACK, listening_sockets
from tests.numerics import assert_all_within_noise, assert_run_exact, relative_error

pytestmark = pytest.mark.ray

FLOAT64 = {"master_dtype": "float64", "compute_dtype": "float64"}
STEPS = 20


def run(cfg, resume: str | None = None) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Losses of a whole run, its initial and final master weights."""
    with Trainer(cfg, resume=resume) as trainer:
        initial = trainer.master_weights()
        losses = [r["loss"] for r in trainer.train()]
        return losses, initial, trainer.master_weights()


class OneRank(NamedTuple):
    """A one-rank float64 run of 20 steps (the schedule of 20), with its weights after 10 steps too."""
    losses: list[float]
    initial: dict[str, torch.Tensor]
    at10: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Callable[[float], OneRank]:
    """The one-rank float64 run (local: one rank in-process is one rank through Ray) by grad_clip, made once for
    the module: the reference of the two-rank runs (20 steps; the two nodes' 10) and, for the float32 streaming
    copy, the float64 twin that measures the float32 noise."""
    runs: dict[float, OneRank] = {}

    def get(clip: float) -> OneRank:
        if clip not in runs:
            cfg = tiny_config(tmp_path_factory.mktemp("one"), optimizer={"grad_clip": clip}, precision=FLOAT64)
            with Trainer(cfg) as trainer:
                initial = trainer.master_weights()
                losses = [trainer.step(s)["loss"] for s in range(10)]
                at10 = trainer.master_weights()
                losses += [trainer.step(s)["loss"] for s in range(10, STEPS)]
                runs[clip] = OneRank(losses, initial, at10, trainer.master_weights())
        return runs[clip]
    return get


def assert_same_run(losses, final, ref_losses, ref_final, initial) -> None:
    """float64: the one-rank run up to summation order, within 1e-10; every tensor moved."""
    assert_run_exact(losses, final, ref_losses, ref_final, initial, moved=1e-4, against="one rank's")


def assert_trace_is_causal(ranks: dict, steps: int, stages: int) -> None:
    """Every hand-off of every update in the order the protocol imposes, on one clock across the processes:
    each rank's piece on the device, then seen by its dispatcher, then announced; the leader orders the
    update only once every piece is announced; the workers run it after the order; the other ranks hear
    of it after it ran."""
    assert sorted(ranks) == [0, 1]
    leader, other = ranks[0], ranks[1]
    for step in range(1, steps + 1):
        for stage in range(stages):
            for events in ranks.values():
                emit, drained, landed = (events[(step, stage, e)] for e in ("emit", "drained", "landed"))
                assert emit <= drained <= landed
                assert events[(step, stage, "gpu_drained")] <= events[(step, stage, "drained")]
            chain = [other[(step, stage, "landed")], *(leader[(step, stage, e)] for e in
                                                      ("landed", "sent", "run_start", "run_end", "applied"))]
            assert chain == sorted(chain), f"step {step} stage {stage}: {chain}"
        assert leader[(step, -1, "step_start")] <= leader[(step, -1, "backward_end")] <= \
            leader[(step, -1, "device_idle")] <= leader[(step, -1, "step_end")]


@pytest.mark.parametrize("clip", [1.0, 0.0], ids=["clip", "noclip"])
def test_two_gpu_workers_give_the_loss_curve_and_weights_of_one(tmp_path, ray_session, one_rank, clip):
    """With clipping the global norm is that of the summed gradients (neither rank's own); without it the
    ranks gather the weights (parallel.gather_weights). The clipped run
    also checkpoints, and one rank resumes from its step-10 checkpoint; in the other, rank 1 is killed in
    step 7 and the run restarts both ranks from its step-5 checkpoint by itself. float64: within 1e-10."""
    ref = one_rank(clip)
    extra = {"checkpoint": {"every": 10}} if clip else \
        {"checkpoint": {"every": 5}, "fault": {"max_restarts": 1, "drill": "kill:gpu1@7"}}
    if clip:  # the run without a restart also writes the update trace
        extra["engine"] = {"update_trace": str(tmp_path / "trace")}
    cfg = tiny_config(tmp_path / "two", optimizer={"grad_clip": clip}, parallel={"gpus": 2, "gather_weights": not clip},
                      runtime={"mode": "ray"}, precision=FLOAT64, **extra)
    with Trainer(cfg) as trainer:
        assert [trainer.actor_names.count(n) for n in ("gpu", "gpu1", "host0", "optim0")] == [1, 1, 1, 1]
        assert len({s.path for s in trainer.specs if s.kind == "master"}) == len(trainer.layout.stages)
        records = trainer.train()
        final = trainer.master_weights()
        assert trainer.restarts == (0 if clip else 1)
    assert {r["gpus"] for r in records} == {2} and records[0]["tokens"] == cfg.data.tokens_per_step
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:  # each rank's wait for updates, the slowest of them the step's
        assert len(r["rank_update_wait_seconds"]) == 2
        assert r["update_wait_seconds"] == max(r["rank_update_wait_seconds"]) >= r["slab_wait_seconds"] >= 0
    assert_same_run([r["loss"] for r in records], final, ref.losses, ref.final, ref.initial)
    if clip:
        assert_trace_is_causal(load_trace(tmp_path / "trace"), steps=STEPS, stages=len(trainer.layout.stages))
        assert all(r["grad_norm"] > clip for r in records[:3])  # clipping was active
        # The checkpoint of a 2-GPU run resumes on 1 GPU and continues the curve.
        step10 = CheckpointDir(tmp_path / "two" / "run" / "checkpoints").root / "step-00000010"
        one = tiny_config(tmp_path / "resumed", optimizer={"grad_clip": clip}, checkpoint={"at_end": False},
                          precision=FLOAT64)
        losses, _, resumed_final = run(one, resume=str(step10))
        assert_same_run(losses, resumed_final, ref.losses[10:], ref.final, ref.initial)


@pytest.mark.float32_parity
def test_two_gpu_workers_equal_one_through_the_streaming_copy(tmp_path, ray_session, one_rank):
    """A float32 streaming copy beside float64 masters: each rank lands its piece of the gradients in the
    shared copy and the optimizer rewrites it (the bf16 layout of GPU runs, at a precision a test holds); each
    rank also loads only its piece of the weights and gathers the rest (parallel.gather_weights, clipping off).
    float32 gradients summed in another order: the two-rank run within 4x the one-rank run's own float32 noise,
    its distance from the same one-rank run in float64 (the module's, after its first 10 steps). Measured on an
    AVX-512 Xeon: noise 4.5e-6 (the weights' largest) and 8.6e-8 (the losses'), the two ranks 2.7e-7 (0.06x)
    and 1.1e-7 (within the floor of 16 ulps) from one rank's; rank 0's gradients weighted 1 + 1e-3: the losses
    2.5x the bound."""
    common = {"precision": {"master_dtype": "float64", "compute_dtype": "float32"}, "optimizer": {"grad_clip": 0.0}}
    losses32, _, final32 = run_steps(tiny_config(tmp_path / "one", **common), 10)
    parallel = {"gpus": 2, "gather_weights": True}
    losses, _, final = run_steps(tiny_config(tmp_path / "two", parallel=parallel, runtime={"mode": "ray"}, **common), 10)
    ref64 = one_rank(0.0)
    steps = range(10)
    assert_all_within_noise("loss at step", dict(zip(steps, losses)), dict(zip(steps, losses32)),
                            dict(zip(steps, ref64.losses[:10])))
    assert_all_within_noise("tensor", final, final32, ref64.at10)
    for name, value in final.items():
        assert relative_error(value, ref64.initial[name]) > 1e-4, f"{name} did not move"


def test_auto_takes_every_gpu_ray_offers_and_one_rank_on_a_cpu_cluster(tmp_path, ray_session):
    from megatrain_ray.driver.parallel import resolve_parallel

    plan = resolve_parallel(tiny_config(tmp_path, parallel={"gpus": "auto"}, runtime={"mode": "ray"}))
    assert (plan.world, plan.use_gpu, plan.backend, plan.same_host) == (1, False, "gloo", True)


def test_a_cluster_lacking_the_nodes_asked_for_is_one_clear_error(tmp_path, ray_session):
    cfg = tiny_config(tmp_path, parallel={"gpus": 2, "nodes": 2}, runtime={"mode": "ray"})
    with pytest.raises(ConfigError, match=r"parallel.nodes=2: the Ray cluster has 1 alive node"):
        with Trainer(cfg):
            pass
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("parallel, local, expected", [
    ({"gpus": 3}, False, "config key 'parallel.gpus' = 3: data.batch_size=4 is not divisible by 3 ranks"),
    ({"gpus": 2}, True, "config key 'parallel.gpus' = 2: more than one GPU worker needs runtime.mode=ray"),
    ({"gpus": 3, "nodes": 2}, False, "config key 'parallel.gpus' = 3: must be a multiple of parallel.nodes=2"),
    ({"gpus": 0}, False, "config key 'parallel.gpus' = 0: must be >= 1"),
    ({"backend": "nccl"}, False, "config key 'parallel.backend' = 'nccl': needs GPUs, but engine.device=cpu"),
    ({"gpus": "two"}, False, "config key 'parallel.gpus' = 'two'"),
])
def test_a_bad_parallel_config_is_one_clear_error(tmp_path, capsys, parallel, local, expected):
    raw = tiny_raw(parallel=parallel, runtime={"mode": "ray"}, train={"output_dir": str(tmp_path / "run")})
    raw["data"]["path"] = learnable_tokens(tmp_path / "tokens.npy", raw["model"]["vocab_size"])
    config = tmp_path / "bad.yaml"
    config.write_text(yaml.safe_dump(raw))
    mine = f"-{os.getpid()}-"  # this process's runs only: other test processes may hold segments meanwhile
    before = {f for f in os.listdir("/dev/shm") if f.startswith("megatrain-") and mine in f}
    assert main(["train", str(config), *(["--local"] if local else [])]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and expected in errors[0], err
    # Python's "--- Logging error ---" report is a handler of an earlier test writing to that test's closed
    # capture (Ray's unhandled-error report of a task it left behind), not this run's output.
    own = re.sub(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n", "", err, flags=re.S)
    assert "Traceback" not in own and not (tmp_path / "run").exists()
    assert {f for f in os.listdir("/dev/shm") if f.startswith("megatrain-") and mine in f} == before


# ----------------------------------------------------------------------------- two Ray nodes on one box


@pytest.fixture(scope="module")
def two_ray_nodes():
    """Two Ray nodes on 127.0.0.1 (ray.cluster_utils.Cluster), each of 2 CPUs; Ray's files and its address
    file in a private temporary directory, so other Ray users of this box never attach to it."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    tmp = tempfile.mkdtemp(prefix="mtdp-")  # short: Ray's socket paths live under it
    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_TMPDIR", tmp)
    patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # every Ray socket on 127.0.0.1 (driver/runtime.py)
    patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                            "object_store_memory": 96 * 2**20})
    try:
        cluster.add_node(num_cpus=2, object_store_memory=96 * 2**20)
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": REPO}})
        yield cluster, tmp
    finally:
        ray.shutdown()
        cluster.shutdown()
        patch.undo()
        shutil.rmtree(tmp, ignore_errors=True)


def test_two_nodes_give_the_run_of_one_and_check_their_copies(tmp_path, two_ray_nodes, one_rank):
    """Two nodes with two ranks each: a reduce-scatter on each node, an all-reduce of the pieces across
    the nodes, weights gathered among a node's ranks (parallel.gather_weights), one host store and one set
    of optimizer workers per node; every Ray and gloo socket on
    127.0.0.1 (float64: the one-rank run within 1e-10). Then node 1's copy is damaged, and the next step stops
    with the nodes' checksums."""
    import ray

    _, ray_tmp = two_ray_nodes
    ref = one_rank(1.0)  # its first 10 steps; the 11th here is the one that finds the damage
    cfg = tiny_config(tmp_path / "two", parallel={"gpus": 4, "nodes": 2, "gather_weights": True}, runtime={"mode": "ray"},
                      precision=FLOAT64)
    with Trainer(cfg) as trainer:
        nodes = [{g.node_id().result(timeout=60) for g in node.gpus} for node in trainer.nodes]
        assert len(nodes[0]) == len(nodes[1]) == 1 and nodes[0] != nodes[1], nodes
        assert nodes[0] == {ray.get_runtime_context().get_node_id()}  # node 0, which checkpoints, is the driver's
        assert not {s.path for s in trainer.nodes[0].specs} & {s.path for s in trainer.nodes[1].specs}
        losses = [trainer.step(s)["loss"] for s in range(10)]
        final = trainer.master_weights()
        name = "model.layers.1.mlp.up_proj.weight"
        trainer.load_weights({name: final[name] + 1e-3}, nodes=[1])
        with pytest.raises(ParallelError, match=r"host copies of the weights differ at train step 11: checksums "
                                                r"node 0: .*, node 1: "):
            trainer.step(10)
        sockets = [(ip, port) for ip, port, pid in listening_sockets() if _in_cluster(pid, ray_tmp)]
    assert_same_run(losses, final, ref.losses[:10], ref.at10, ref.initial)
    assert sockets and all(ip in LOOPBACK for ip, _ in sockets), sockets


def run_steps(cfg, steps: int) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    with Trainer(cfg) as trainer:
        initial = trainer.master_weights()
        losses = [trainer.step(s)["loss"] for s in range(steps)]
        return losses, initial, trainer.master_weights()


def _in_cluster(pid: int, ray_tmp: str) -> bool:
    """A process of the test cluster: Ray's own and its workers, which inherit RAY_TMPDIR."""
    try:
        return f"RAY_TMPDIR={ray_tmp}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
