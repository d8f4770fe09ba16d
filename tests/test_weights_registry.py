"""Weight transports by name and payload: the built-ins, a plugin (one file + one register
line, tests/plugins/recording_transport.py) selected and used by the run, and what the run asks
a transport instead of reading `--lora-rank`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slime_async.config import parse_config
from slime_async.contracts.adapter import ADAPTER_NAME
from slime_async.contracts.weights import Payload
from slime_async.orchestrator.transport import (
    build_transport,
    lora_name,
    serves_start_export,
    start_source,
    transport_class,
)
from slime_async.weights import (
    AdapterTransport,
    DiskTransport,
    DistributedAdapterTransport,
    DistributedTransport,
    get_weight_transport,
    register_weight_transport,
)

PLUGIN = "tests.plugins.recording_transport:recording"


def _cfg(tmp_path: Path, *extra: str):
    return parse_config(["--run-dir", str(tmp_path / "run"), "--num-steps", "2", *extra])


def _with_transport(cfg, name: str):
    return dataclasses.replace(cfg, weights=dataclasses.replace(cfg.weights, transport=name))


class _Trainer:
    """Writes a version's 'HF directory' (a marker file)."""

    def __init__(self) -> None:
        self.saved: list[Path] = []

    def save_weights(self, path, dtype=None):
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "model.safetensors").write_text("w")
        self.saved.append(path)
        return path


class _Control:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def update_weights_from_disk(self, path, **kw):
        self.calls.append(("load", path, kw["weight_version"]))

    async def pause_generation(self, mode):
        self.calls.append(("pause", mode))

    async def continue_generation(self):
        self.calls.append(("continue",))


class _Cluster:
    def __init__(self) -> None:
        self.control = _Control()
        self.engine_urls = ["http://127.0.0.1:1"]


class _Needs:
    collective_backend = "gloo"
    model_dir = True


class _Backend:
    needs = _Needs()


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        (("--update-weight-transport", "disk"), DiskTransport),
        (("--update-weight-transport", "distributed"), DistributedTransport),
        (("--lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj"), AdapterTransport),
        (
            (
                "--lora-rank",
                "4",
                "--lora-target-modules",
                "q_proj",
                "v_proj",
                "--update-weight-transport",
                "distributed",
            ),
            DistributedAdapterTransport,
        ),
    ],
)
def test_the_run_selects_the_transport_of_its_flag_and_payload(tmp_path, extra, want):
    cfg = _cfg(tmp_path, *extra)
    cls = transport_class(cfg)
    assert cls is want
    adapter = cls.payload is Payload.ADAPTER
    assert adapter == bool(cfg.trainer.lora_rank)
    assert lora_name(cls) == (ADAPTER_NAME if adapter else None)
    # engines start on the trainer's export unless the full weights travel without files
    first = tmp_path / "weights" / "v000000"
    full_by_group = want is DistributedTransport
    assert (start_source(cfg, cls, first) == str(first.resolve())) != full_by_group
    assert serves_start_export(cls, _Backend()) == (want is DiskTransport)


async def test_a_plugin_transport_is_selected_and_used_by_the_run(tmp_path):
    cfg = _with_transport(_cfg(tmp_path), PLUGIN)
    cls = transport_class(cfg)  # imports the plugin module, whose last line registers it
    assert (
        cls.__name__ == "RecordingTransport"
        and cls.__module__ == "tests.plugins.recording_transport"
    )
    assert get_weight_transport("recording", Payload.FULL) is cls
    cluster, trainer, fed = _Cluster(), _Trainer(), []

    class _Role:
        def add_version(self, version, path):
            fed.append((version, path))

    t = build_transport(
        cls, cfg, trainer=trainer, cluster=cluster, backend=_Backend(), role=_Role()
    )
    assert isinstance(t, cls) and t.root == cfg.run_dir / "plugin-weights"
    metrics = await t.push(1)
    assert t.loaded == [(1, False)] and metrics["weights/push_failed_engines"] == 0.0
    assert trainer.saved == [cfg.run_dir / "plugin-weights" / "v000001"]
    assert fed == [(1, trainer.saved[0].resolve())]  # the role's feed: the directory written
    assert [c[0] for c in cluster.control.calls] == ["pause", "load", "continue"]
    assert t.directory(1).is_dir()


def test_a_plugin_without_the_payload_of_the_run_is_refused_with_the_choices(tmp_path):
    cfg = _with_transport(
        _cfg(tmp_path, "--lora-rank", "4", "--lora-target-modules", "q_proj", "v_proj"), PLUGIN
    )
    with pytest.raises(ValueError, match="no weight transport 'recording' moves the adapter"):
        transport_class(cfg)


def test_registering_checks_the_protocol_and_refuses_a_second_class_for_a_name(tmp_path):
    class NotATransport:
        payload = Payload.FULL

    with pytest.raises(TypeError, match="lacks 'shared_filesystem'"):
        register_weight_transport("broken", NotATransport)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        register_weight_transport("disk", DistributedTransport)
    with pytest.raises(ValueError, match="cannot be imported"):
        transport_class(_with_transport(_cfg(tmp_path), "no_such_module_x:t"))
