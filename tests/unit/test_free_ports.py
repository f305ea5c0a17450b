"""driver/ray_setup.free_ports: the ports handed to Ray's components are distinct. Chosen one at a time (bind,
read, close), the kernel may give the same port twice, and Ray refuses to start with two components on one port:
the suite saw `runtime_env_agent is trying to use a port number 33743 that is used by other components`."""

from __future__ import annotations

import socket

from megatrain_ray.driver.ray_setup import AGENT_PORT_KEYS, agent_ports, free_ports


def test_free_ports_are_distinct_and_free():
    ports = free_ports(200)
    assert len(set(ports)) == 200
    for port in ports[:20]:  # nothing holds them once returned
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_agent_ports_cover_the_agents_and_the_extra_names_once_each():
    ports = agent_ports("dashboard_port")
    assert list(ports) == [*AGENT_PORT_KEYS, "dashboard_port"]
    assert len(set(ports.values())) == len(ports)
