"""A trainer role that records the batch of every step it takes, for tests that compare a run's update
with one computed again on the same samples (`RUN_DIR/recorded/<trainer peer>-v<version>.msgpack`: the
wire form of each sample (`mas_async.wire.codec`), in the order the step received them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mas_async.config import Config
from mas_async.deployment import Deployment
from mas_async.launch.roles import ROLES, seed_torch
from mas_async.peer_names import trainer_peer
from mas_async.wire.codec import pack, unpack
from mas_async.wire.messages import sample_from_wire, sample_to_wire
from mas_async.wire.samples import Sample


def recorded_path(run_dir: Path, policy: str, rank: int, version: int) -> Path:
    return run_dir / "recorded" / f"{trainer_peer(policy, rank).replace('/', '-')}-v{version}.msgpack"


def load_recorded(run_dir: Path, policy: str, rank: int, version: int) -> list[Sample]:
    values = unpack(recorded_path(run_dir, policy, rank, version).read_bytes(), max_bytes=1 << 30, max_objects=1 << 26)
    return [sample_from_wire(v) for v in values]


def recording_trainer(config: Config, deployment: Deployment, run_dir: Path, *, index: int, policy: str) -> Any:
    seed_torch(config)
    from mas_async.training.trainer import Trainer

    trainer = Trainer(config, deployment, policy, run_dir, rank=index)
    admit = trainer.admit

    def recorded(received: list[Sample], version: int) -> tuple[list[Sample], int, int]:
        # What the step trains on, streamed or not: the samples the version rule admits.
        batch, *refused = admit(received, version)
        path = recorded_path(run_dir, policy, index, version)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(pack([sample_to_wire(s) for s in batch]))
        return batch, *refused

    trainer.admit = recorded  # type: ignore[method-assign]
    return trainer


RECORDING_ROLES = {**ROLES, "trainer": recording_trainer}
