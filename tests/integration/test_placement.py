"""Placement through real Ray on a simulated two-node topology, and actor health.

The box has 2 CPUs and one NUMA node; a fake sysfs tree (node0: cpu 0, node1: cpu 1) makes it
look like two sockets, and the private Ray declares `numa_node_0` and `numa_node_1` for it.
"""

from __future__ import annotations

import logging
import time

import pytest

from actors.base import ActorBase
from megatrain_ray.config.runtime_sections import RuntimeConfig
from megatrain_ray.driver.faults import HealthMonitor
from megatrain_ray.driver.placement import RayPlacement, numa_resources
from megatrain_ray.driver.runtime import spawn, start_ray
from megatrain_ray.driver.trainer import Trainer
from megatrain_ray.system import topology
from tests.conftest import tiny_config
from tests.unit.test_topology import fake_sysfs

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_node_ray(tmp_path_factory):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    root = fake_sysfs(tmp_path_factory.mktemp("sysfs") / "node", ["0", "1"])
    patch = pytest.MonkeyPatch()
    patch.setattr(topology, "NODE_SYSFS", root)
    patch.setattr(topology, "CGROUP_ROOT", root / "no-cgroup")
    started = start_ray(RuntimeConfig(dashboard=False, object_store_mb=128),
                        resources=numa_resources(topology.detect_topology()))
    yield
    patch.undo()
    if started:
        ray.shutdown()


def test_each_optimizer_worker_runs_pinned_in_its_numa_bundle(two_node_ray, tmp_path):
    cfg = tiny_config(tmp_path, runtime={"mode": "ray"}, optimizer={"workers": "auto"}, host={"num_shards": 2},
                      train={"steps": 3})
    with Trainer(cfg) as trainer:
        plan = trainer.placement.plan
        assert [(w.node, w.cores) for w in plan.workers] == [(0, (0,)), (1, (1,))]
        statuses = {name: h.heartbeat().result(timeout=30) for name, h in trainer.actor_handles().items()}
        for w in plan.workers:
            status = statuses[f"optim{w.index}"]
            assert status.cores == w.cores  # read back from the actor's own os.sched_getaffinity
            assert status.resources.get(f"numa_node_{w.node}", 0) > 0, status.resources
            assert not any(k.startswith("numa_node_") and k != f"numa_node_{w.node}" for k in status.resources)
        assert statuses["host0"].cores == (0,) and statuses["host1"].cores == (1,)
        assert statuses["host1"].resources.get("numa_node_1", 0) > 0
        assert len({s.pid for s in statuses.values()}) == len(statuses)
        records = trainer.train()
    assert len(records) == 3 and records[-1]["loss"] > 0


def test_a_cluster_without_numa_resources_gets_plain_cpu_bundles(two_node_ray, caplog):
    """A topology whose nodes the cluster does not declare (as a cluster started without --resources)."""
    topo = topology.Topology((topology.NumaNode(6, (0,)), topology.NumaNode(7, (1,))), "test")
    plan = topology.plan_placement(topo, 2, num_shards=1)
    with caplog.at_level(logging.INFO, logger="megatrain_ray"):
        placement = RayPlacement(plan, use_gpu=False)
    try:
        assert "numa_node_6, numa_node_7" in caplog.text
        assert all(not any(k.startswith("numa_node") for k in b) for b in placement.bundles)
        assert placement.options("optim1")["num_cpus"] > 0
    finally:
        placement.remove()


class Patient(ActorBase):
    """Busy in its default group for as long as it is told; its heartbeat still answers."""

    def work(self, seconds: float) -> None:
        time.sleep(seconds)


class Frozen(ActorBase):
    def heartbeat(self):
        time.sleep(60)


def test_health_names_slow_and_dead_actors(two_node_ray, caplog):
    handles = {name: spawn("ray", cls, name=f"health-test-{name}")
               for name, cls in (("busy", Patient), ("frozen", Frozen), ("doomed", Patient))}
    for handle in handles.values():
        handle.pid().result(timeout=60)
    busy = handles["busy"].work(6.0)
    ages: dict[str, float] = {}
    monitor = HealthMonitor(handles, interval_s=0.3, timeout_s=2.0, on_age=ages.__setitem__)
    with caplog.at_level(logging.INFO, logger="megatrain_ray"):
        monitor.start()
        handles["doomed"].kill()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not ("frozen is slow" in caplog.text and monitor.dead_actors()):
            time.sleep(0.2)
        monitor.stop()
    busy.result(timeout=30)
    for handle in handles.values():
        handle.kill()
    assert "actor frozen is slow: no heartbeat answer" in caplog.text
    assert "actor busy is slow" not in caplog.text  # a long call does not block heartbeats
    assert list(monitor.dead_actors()) == ["doomed"] and "actor doomed is dead" in caplog.text
    assert ages["frozen"] > 2.0 and ages["busy"] < 2.0
