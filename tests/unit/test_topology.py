"""NUMA topology from a simulated sysfs tree, and the core map built from it (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain_ray.system.topology import detect_topology, format_cpus, parse_cpulist, plan_placement


def fake_sysfs(root: Path, nodes: list[str]) -> Path:
    """/sys/devices/system/node as the kernel lays it out: nodeN/cpulist per node."""
    for index, cpulist in enumerate(nodes):
        (root / f"node{index}").mkdir(parents=True)
        (root / f"node{index}" / "cpulist").write_text(cpulist + "\n")
    (root / "online").write_text(f"0-{len(nodes) - 1}\n")
    return root


def two_sockets(tmp_path: Path, cpus_per_node: int = 16):
    root = fake_sysfs(tmp_path / "node", [f"0-{cpus_per_node - 1}", f"{cpus_per_node}-{2 * cpus_per_node - 1}"])
    return detect_topology(root, allowed=set(range(2 * cpus_per_node)), cgroup_root=tmp_path / "nocgroup")


def test_cpulists_round_trip():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert format_cpus((0, 1, 2, 3, 8, 10, 11)) == "0-3,8,10-11"


def test_nodes_keep_only_the_cpus_this_process_may_use(tmp_path):
    root = fake_sysfs(tmp_path / "node", ["0-3", "4-7", ""])  # node 2: memory only
    topo = detect_topology(root, allowed={1, 2, 3, 5}, cgroup_root=tmp_path / "nocgroup")
    assert [(n.index, n.cpus) for n in topo.nodes] == [(0, (1, 2, 3)), (1, (5,))]


def test_without_numa_information_everything_is_one_node(tmp_path):
    topo = detect_topology(tmp_path / "missing", allowed={0, 1, 2}, cgroup_root=tmp_path / "nocgroup")
    assert [(n.index, n.cpus) for n in topo.nodes] == [(0, (0, 1, 2))]
    assert "one node" in topo.source


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_a_cgroup_quota_trims_the_cpus_across_nodes(tmp_path, layout):
    cgroup = tmp_path / "cgroup"
    if layout == "v2":
        cgroup.mkdir()
        (cgroup / "cpu.max").write_text("600000 100000\n")  # 6 CPUs
    else:
        (cgroup / "cpu").mkdir(parents=True)
        (cgroup / "cpu" / "cpu.cfs_quota_us").write_text("600000\n")
        (cgroup / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    root = fake_sysfs(tmp_path / "node", ["0-7", "8-15"])
    topo = detect_topology(root, allowed=set(range(16)), cgroup_root=cgroup)
    assert [len(n.cpus) for n in topo.nodes] == [3, 3] and "quota" in topo.source


def test_auto_puts_a_few_workers_on_every_node_on_disjoint_cores(tmp_path):
    plan = plan_placement(two_sockets(tmp_path), "auto", num_shards=2)
    assert [w.node for w in plan.workers] == [0, 0, 1, 1]
    cores = [set(w.cores) for w in plan.workers]
    assert all(a.isdisjoint(b) for i, a in enumerate(cores) for b in cores[i + 1:])
    for w in plan.workers:  # each worker's cores lie on its own node
        assert set(w.cores) <= set(plan.topology.nodes[w.node].cpus)
    # The GPU's node keeps two cores for the GPU worker and the shards; no worker uses them.
    assert plan.gpu_node == 0 and plan.gpu_cores == ((0, 1),) and plan.reserved_cores == (0, 1)
    assert not set(plan.reserved_cores) & set().union(*cores)
    assert plan.shard_nodes == (0, 1)
    assert "optim2 -> node 1" in plan.summary()


def test_each_gpu_worker_of_a_node_gets_cores_of_its_own(tmp_path):
    """Two GPU workers on a 32-core node (nvidia-h200-x2): two cores each, apart from AdamW's."""
    topo = detect_topology(fake_sysfs(tmp_path / "node", ["0-31"]), allowed=set(range(32)),
                           cgroup_root=tmp_path / "nocgroup")
    plan = plan_placement(topo, 4, num_shards=1, gpu_ranks=2)
    assert plan.gpu_cores == ((0, 1), (2, 3)) and plan.reserved_cores == (0, 1, 2, 3)
    worker_cores = set().union(*(w.cores for w in plan.workers))
    assert worker_cores == set(range(4, 32))  # 4 workers x 7 cores
    assert "cpus 0-1; cpus 2-3" in plan.summary()
    # One GPU worker: 30 cores do not split evenly over 4 workers; the 2 left over are the GPU worker's too.
    plan = plan_placement(topo, 4, num_shards=1, gpu_ranks=1)
    assert set().union(*(w.cores for w in plan.workers)) == set(range(2, 30))
    assert plan.gpu_cores == ((0, 1, 30, 31),)
    # A node that would keep AdamW fewer than MIN_OPTIMIZER_CORES reserves nothing: the ranks share it.
    small = detect_topology(fake_sysfs(tmp_path / "small", ["0-9"]), allowed=set(range(10)),
                            cgroup_root=tmp_path / "nocgroup")
    plan = plan_placement(small, 2, num_shards=1, gpu_ranks=3)
    assert plan.gpu_cores == (tuple(range(10)),) * 3
    assert set().union(*(w.cores for w in plan.workers)) == set(range(10))


def test_an_explicit_count_is_spread_over_nodes_by_cores(tmp_path):
    plan = plan_placement(two_sockets(tmp_path), 3, num_shards=1, gpu_node=1)
    assert sorted(w.node for w in plan.workers) == [0, 0, 1]  # node 1 gives two cores to the GPU
    assert plan.gpu_node == 1 and plan.shard_nodes == (0,)
    cores = [set(w.cores) for w in plan.workers]
    assert all(a.isdisjoint(b) for i, a in enumerate(cores) for b in cores[i + 1:])


def test_fewer_workers_than_nodes_go_to_the_nodes_with_the_most_cores(tmp_path):
    plan = plan_placement(two_sockets(tmp_path), 1, num_shards=2, gpu_node=1)
    assert [w.node for w in plan.workers] == [0]  # node 1 gives two cores to the GPU: node 0 has more
    assert plan.workers[0].cores == tuple(range(16)) and plan.shard_nodes == (0, 0)


def test_small_boxes_reserve_nothing_and_more_workers_than_cores_share(tmp_path):
    root = fake_sysfs(tmp_path / "node", ["0-1"])
    topo = detect_topology(root, allowed={0, 1}, cgroup_root=tmp_path / "nocgroup")
    assert [w.cores for w in plan_placement(topo, "auto", 1).workers] == [(0, 1)]
    plan = plan_placement(topo, 3, 1)
    assert [w.cores for w in plan.workers] == [(0,), (1,), (0,)] and plan.shared_cores


def test_bind_process_pins_the_threads_that_already_run_and_those_started_later():
    """Ray's threads (and CUDA's, started by the device check) exist before an actor pins itself."""
    import subprocess
    import sys

    script = """
import os, threading
from megatrain_ray.system.topology import bind_process
core = min(os.sched_getaffinity(0))
seen, go = {}, threading.Event()
def report(name):
    go.wait()
    seen[name] = sorted(os.sched_getaffinity(0))
early = threading.Thread(target=report, args=("early",)); early.start()
bind_process([core])
late = threading.Thread(target=report, args=("late",)); late.start()
go.set(); early.join(); late.join()
assert seen == {"early": [core], "late": [core]}, seen
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_host_shards_fill_their_stages_on_their_share_of_the_node_and_then_keep_to_their_cores(tmp_path):
    """At start-up no optimizer or GPU worker exists: a shard on the GPU's node (bound to the GPU worker's two
    cores) fills its stages on the node's 16 (two shards of a node split them), and moves back afterwards."""
    import os

    from megatrain_ray.system.topology import move_thread, shard_start_up_cores

    topo = detect_topology(fake_sysfs(tmp_path / "one", ["0-15"]), allowed=set(range(16)),
                           cgroup_root=tmp_path / "nocgroup")
    plan = plan_placement(topo, "auto", num_shards=1)
    assert plan.reserved_cores == (0, 1) and shard_start_up_cores(plan, 0) == tuple(range(16))
    plan = plan_placement(topo, "auto", num_shards=2)
    assert [shard_start_up_cores(plan, k) for k in (0, 1)] == [tuple(range(8)), tuple(range(8, 16))]
    plan = plan_placement(two_sockets(tmp_path), "auto", num_shards=2)
    assert [shard_start_up_cores(plan, k) for k in (0, 1)] == [plan.topology.nodes[0].cpus,
                                                                plan.topology.nodes[1].cpus]
    mine = tuple(sorted(os.sched_getaffinity(0)))
    before = move_thread(mine[:1])
    assert before == mine and os.sched_getaffinity(0) == {mine[0]}
    assert move_thread(before) == mine[:1] and tuple(sorted(os.sched_getaffinity(0))) == mine
    assert move_thread(()) == ()  # in-process: nothing moves


def test_a_lora_run_plans_and_logs_no_optimizer_workers_and_says_who_updates(tmp_path):
    """finetune.method=lora spawns no optimizer worker (driver/cluster.py): the placement gives none a core or a
    Ray bundle, and its log line (the plan's summary) says the GPU worker updates the adapters, not '1 optimizer
    worker(s)'."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.driver.placement import RunPlacement, actor_slots
    from tests.conftest import tiny_raw

    topology = detect_topology(tmp_path / "missing", allowed=set(range(16)), cgroup_root=tmp_path / "nocgroup")
    for method in ("full", "lora"):
        placement = RunPlacement(load_config(raw=tiny_raw(finetune={"method": method})), use_gpu=False,
                                 topology=topology)
        line = placement.plan.summary()
        names = [s.name for s in actor_slots(placement.plan, use_gpu=False)]
        if method == "full":
            assert "1 optimizer worker(s)" in line and placement.num_workers == 1 and "optim0" in names
        else:
            assert "optimizer worker(s)" not in line and placement.num_workers == 0 and names == ["gpu", "host0"]
            assert "no optimizer workers (finetune.method=lora: the GPU worker updates the adapters itself" in line


def test_a_generation_session_logs_no_optimizer_workers(tmp_path):
    """megatrain generate/chat on a full-weights model hold it forward only (RunSpec.frozen_base) and spawn no
    optimizer worker (driver/cluster.py): the placement's line says so, not '1 optimizer worker(s)'."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.driver.placement import RunPlacement, actor_slots
    from tests.conftest import tiny_raw

    topology = detect_topology(tmp_path / "missing", allowed=set(range(16)), cgroup_root=tmp_path / "nocgroup")
    placement = RunPlacement(load_config(raw=tiny_raw()), use_gpu=False, topology=topology, frozen_base=True)
    line = placement.plan.summary()
    assert "optimizer worker(s)" not in line and placement.num_workers == 0
    assert "no optimizer workers (forward only: megatrain generate/chat" in line, line
    assert [s.name for s in actor_slots(placement.plan, use_gpu=False)] == ["gpu", "host0"]


def test_a_separate_rollout_gets_cores_and_a_gpu_bundle_of_its_own(tmp_path):
    """rl.rollout: separate: the placement reserves cores for one GPU worker more, the rollout worker's, and its Ray
    bundle asks for a GPU as the GPU workers' do."""
    from megatrain_ray.config.load import load_config
    from megatrain_ray.driver.placement import ROLLOUT_ACTOR, RunPlacement, actor_slots
    from tests.conftest import tiny_raw

    topology = detect_topology(tmp_path / "missing", allowed=set(range(16)), cgroup_root=tmp_path / "nocgroup")
    cfg = load_config(raw=tiny_raw())
    plain = RunPlacement(cfg, use_gpu=True, topology=topology)
    placement = RunPlacement(cfg, use_gpu=True, topology=topology, rollout=True)
    slots = {s.name: s for s in actor_slots(placement.plan, use_gpu=True, rollout=True)}
    assert slots[ROLLOUT_ACTOR].bundle["GPU"] == 1.0 and slots["gpu"].bundle["GPU"] == 1.0
    assert not set(slots[ROLLOUT_ACTOR].cores) & set(slots["gpu"].cores)
    workers = {c for w in placement.plan.workers for c in w.cores}
    assert not workers & set(slots[ROLLOUT_ACTOR].cores)  # the optimizer keeps off the rollout worker's cores
    assert len(placement.plan.gpu_cores) == len(plain.plan.gpu_cores) + 1
