"""The one line a run prints when it loses a trainer rank (`slime_async.node_loss`): node, rank,
the newest complete checkpoint read from a real `--save` directory, and a resume command that
is the run's own command line with `--load`. The two-node run: tests/test_node_loss.py."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from slime_async.node_loss import last_checkpoint, resume_command, trainer_lost_message

ARGV = ["train_async.py", "--num-steps", "8", "--load", "/old", "--save", "/ck", "--load=/x"]
LOST = [(1, "10.0.0.2", "its actor is gone (ActorDiedError)")]


def _fake_checkpoint(save: Path, version: int) -> None:
    """What `checkpoint.find_latest(hashes=False)` accepts: `latest`, meta.json, model.pt."""
    from slime_async.trainer import checkpoint

    d = save / checkpoint.iter_name(version)
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(b"weights")
    files = {"model.pt": {"bytes": 7, "sha256": ""}}  # find_latest(hashes=False): sizes only
    meta = {"format": checkpoint.FORMAT, "version": version, "files": files}
    meta["meta_sha256"] = checkpoint._meta_digest(meta)
    (d / "meta.json").write_text(json.dumps(meta))
    (save / "latest").write_text(f"{version}\n")


def test_resume_command_replaces_load() -> None:
    cmd = shlex.split(resume_command(ARGV, "/ck"))
    assert cmd[1:] == ["train_async.py", "--num-steps", "8", "--save", "/ck", "--load", "/ck"]


def test_message_names_node_rank_checkpoint_and_resume(tmp_path: Path) -> None:
    assert last_checkpoint(None) is None and last_checkpoint(tmp_path / "none") is None
    _fake_checkpoint(tmp_path, 3)
    assert last_checkpoint(tmp_path) == 3
    msg = trainer_lost_message(LOST, step=5, save=tmp_path, argv=ARGV)
    assert "\n" not in msg
    assert msg.startswith("lost trainer rank 1 on node 10.0.0.2: its actor is gone"), msg
    assert f"step 3 in {tmp_path} (steps 4..5 are trained again)" in msg, msg
    assert msg.endswith(f"--load {tmp_path}"), msg
    assert "(step 4 is trained again)" in trainer_lost_message(
        LOST, step=4, save=tmp_path, argv=ARGV
    )
    assert "trained again" not in trainer_lost_message(LOST, step=3, save=tmp_path, argv=ARGV)
    no_save = trainer_lost_message(LOST, step=5, save=None, argv=ARGV)
    assert "no --save" in no_save and "--save DIR" in no_save
    empty = trainer_lost_message(LOST, step=1, save=tmp_path / "empty", argv=ARGV)
    assert "No complete checkpoint" in empty
