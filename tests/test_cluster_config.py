"""Cluster-mode rules of the run's configuration and the per-node core split (pure functions: the
placement itself runs in tests/test_cluster_netns.py and tests/test_engine_sglang_launch.py)."""

from __future__ import annotations

import pytest

from slime_async.config import build_parser, validate
from slime_async.config.run_config import Environment
from slime_async.contracts.model import TINY_MOE
from slime_async.host import ray_address
from slime_async.orchestrator.placement import Slot, split_node_cores


def _validate(*argv: str, address: str | None = None, token: str | None = None):
    env = Environment(model=TINY_MOE, cpus=(0, 1, 2, 3), ray_address=address, auth_token=token)
    return validate(build_parser().parse_args(list(argv)), env)


def test_joining_a_cluster_needs_the_admin_key() -> None:
    with pytest.raises(ValueError, match="SLIME_ASYNC_AUTH_TOKEN") as e:
        _validate(address="10.0.0.1:6379")
    assert "--auth-token-file" in str(e.value)
    cfg = _validate(address="10.0.0.1:6379", token="t0k")
    assert cfg.engine.admin_api_key == "t0k" == cfg.router.admin_api_key
    assert cfg.engine.api_key == cfg.router.api_key and cfg.engine.api_key not in (None, "t0k")
    assert "minted" in cfg.derived["--api-key-file"].value
    assert cfg.trainer_cores == () == cfg.rollout_cores and not cfg.colocate


def test_local_runs_keep_loopback_and_the_machine_core_split() -> None:
    cfg = _validate()
    assert cfg.ray_address is None and cfg.engine.admin_api_key is None is cfg.engine.api_key
    assert cfg.trainer_cores == (0, 1) and cfg.rollout_cores == (2, 3)


def test_this_machines_cores_are_refused_on_a_joined_cluster() -> None:
    with pytest.raises(ValueError, match="pins cores of its own node"):
        _validate("--trainer-cores", "0", address="h:1", token="t")


def test_one_admin_key_for_router_and_engines() -> None:
    with pytest.raises(ValueError, match="one admin key"):
        _validate("--router-auth-token", "a", token="b")
    cfg = _validate("--router-auth-token", "a")  # the deprecated flag becomes the admin key
    assert cfg.engine.admin_api_key == "a"


def test_ranks_and_engines_from_slimes_flags() -> None:
    cfg = _validate(
        "--actor-num-nodes",
        "2",
        "--actor-num-gpus-per-node",
        "2",
        "--expert-model-parallel-size",
        "2",
        "--rollout-num-gpus",
        "3",
    )
    assert cfg.trainer.world_size == 4 and cfg.trainer.data_parallel_size == 4
    assert (
        cfg.engines.num_engines == 3 and "--rollout-num-gpus 3" in cfg.derived["--num-engines"].why
    )
    assert cfg.derived["--colocate"].value is False and "--rollout-num-gpus" not in cfg.derived
    assert _validate().derived["--rollout-num-gpus"].value == 1  # derived, recorded, not set


def test_ray_address_flag_env_and_local(monkeypatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "10.1.1.1:6379")
    assert ray_address(None) == "10.1.1.1:6379" and ray_address("h:1") == "h:1"
    monkeypatch.setenv("RAY_ADDRESS", "local")
    assert ray_address(None) is None
    monkeypatch.delenv("RAY_ADDRESS")
    assert ray_address(None) is None


def _slot(node: str, cpus: float, cores: tuple[int, ...]) -> Slot:
    return Slot(
        pg=None, index=0, resources={"CPU": cpus}, node_id=node, node_ip=node, port=1, cores=cores
    )  # type: ignore[arg-type]


def test_each_node_splits_its_own_cores_by_reserved_cpus() -> None:
    a, b = tuple(range(8)), (4, 5, 6)  # node b may use other cores than the driver
    slots = [_slot("a", 1, a), _slot("a", 1, a), _slot("b", 1, b), _slot("a", 2, a)]
    out = split_node_cores(slots)
    assert [s.cores for s in out] == [(0, 1), (2, 3), (4, 5, 6), (4, 5, 6, 7)]
    crowded = split_node_cores([_slot("c", 1, (0,)), _slot("c", 1, (0,))])
    assert [s.cores for s in crowded] == [(0,), (0,)]  # fewer cores than bundles: they share
