"""The Ray actor wrapper: a 2-rank trainer group (fractional CPUs) trains, exports, saves, with
--train-env-vars in every rank's environment."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from slime_async.contracts.model import TINY_MOE

pytestmark = [pytest.mark.timeout(240), pytest.mark.own_ray]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    yield ray
    ray.shutdown()


def test_trainer_group_over_ray_matches_in_process(ray_session, tmp_path):
    from slime_async.trainer import weights_io
    from slime_async.trainer.actor import TrainerGroup
    from slime_async.trainer.config import TrainerConfig
    from slime_async.trainer.testing import load_hf, random_batch
    from slime_async.trainer.trainer import MegatronTrainer

    cfg = TrainerConfig(lr=1e-3, micro_batch_size=2, seed=2, clip_grad=0.0)
    ref = MegatronTrainer(cfg, TINY_MOE)
    init = ref.save_weights(tmp_path / "init")
    batch = random_batch(TINY_MOE, batch=4, width=16, prompt=4, seed=1)
    want = ref.train_step(batch)
    # three actors of 0.25 CPU would not fit as num_cpus=1 each on a 2-CPU node
    group = TrainerGroup(
        TrainerConfig(
            lr=1e-3,
            micro_batch_size=2,
            seed=2,
            clip_grad=0.0,
            tensor_model_parallel_size=2,
            hf_checkpoint=str(init),
            train_env_vars='{"SLIME_ASYNC_TEST_ENV": "from --train-env-vars"}',
        ),
        TINY_MOE,
        world_size=2,
        timeout_s=180,
    )
    try:
        env = [  # slime's --train-env-vars reach every rank through Ray's runtime_env
            ray_session.get(a.__ray_call__.remote(lambda _: os.environ.get("SLIME_ASYNC_TEST_ENV")))
            for a in group.actors
        ]
        assert env == ["from --train-env-vars"] * 2
        got = group.train_step(batch)
        assert got.version == group.version() == 1  # the step returns the version it made
        assert abs(got.metrics["loss/total"] - want["loss/total"]) <= 1e-5
        lp, ent = group.compute_logprobs(batch)
        assert lp.shape == (4, 16) and ent.shape == (4, 16)
        ref_lp, _ = ref.compute_logprobs(batch)
        assert abs(torch.from_numpy(lp) - ref_lp).max() <= 1e-4
        out = group.save_weights(tmp_path / "v1")
        hf = load_hf(out, torch.float32)
        assert sum(p.numel() for p in hf.parameters()) > 1_000_000
        # the forward-only role's copies: one file rank 0 writes, or an object-store ref that
        # only the role fetches; both the saved version's tensors, in the parameters' dtype
        node, n = asyncio.run(group.write_weights_file(tmp_path / "v1.safetensors"))
        assert node == ray_session.get_runtime_context().get_node_id()
        assert n == (tmp_path / "v1.safetensors").stat().st_size
        mapped, meta = weights_io.map_tensor_file(tmp_path / "v1.safetensors")
        ref = asyncio.run(group.export_weights_ref())
        assert isinstance(ref, ray_session.ObjectRef) and meta["weight_version"] == "1"
        put, saved = ray_session.get(ref), weights_io.read_hf_dir(out)
        assert put.version == 1 and mapped.keys() == put.tensors.keys() == saved.tensors.keys()
        for k, t in saved.tensors.items():
            assert torch.equal(mapped[k], t) and torch.equal(put.tensors[k], t), k
        ck = group.save_checkpoint(tmp_path / "ck", extra_state={"controller": {"step": 1}})
        assert ck.name == "iter_0000001" and (ck / "meta.json").is_file()
    finally:
        group.shutdown()


def test_a_taken_rendezvous_port_builds_the_trainer_again_on_another(ray_session, monkeypatch):
    """The port found free can be taken before rank 0 binds it (another process on the
    node): the group is built again on another port, not failed. Two ranks: a one-rank group
    binds no port (`parallel.init_distributed`)."""
    import socket

    import slime_async.trainer.actor as actor_mod
    from slime_async.trainer.config import TrainerConfig

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    taken = held.getsockname()[1]
    real, calls = actor_mod.free_port, []

    def racy_free_port() -> int:
        calls.append(1)
        return taken if len(calls) == 1 else real()

    monkeypatch.setattr(actor_mod, "free_port", racy_free_port)
    try:
        group = actor_mod.TrainerGroup(
            TrainerConfig(micro_batch_size=2, seed=2), TINY_MOE, world_size=2, timeout_s=180
        )
        try:
            assert group.version() == 0 and group.master[1] != taken and len(calls) == 2
        finally:
            group.shutdown()
    finally:
        held.close()
