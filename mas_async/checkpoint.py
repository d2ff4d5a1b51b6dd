"""Checkpoints of a run, and which one a resumed run starts from.

Layout under RUN_DIR/checkpoints/:
- `<policy>/v<version>/`: the policy's weights in the dtype its servers serve (`save_pretrained`, loadable
  by an inference server as a model folder; with LoRA the merged model, merged from the float32 master,
  and the adapters as the trainer keeps them in `adapter/`) and `trainer_state.pt` (optimiser, scheduler,
  RNG states, version, the loss scaler of float16 compute, and the trainer's float32 master weights where
  the folder holds them rounded: a resume continues from exactly the weights and state it left). With
  `trainer.distributed_optimizer` each rank's master shard and its Adam state are a file of their own in the
  folder, `optimizer-rank<r>-of-<N>.pt` (each rank writes its own beside the folder, rank 0 moves them in:
  the run directory is on a file system every rank sees); a resume with other ranks re-shards them. Each
  policy has its own folder, so checkpoints of different policies never overwrite each other.
- `router/v<version>.json`: the router's data position at that version (the next iteration).
- `best.json`: the version with the best held-out success so far (`eval/team_success_rate`) and that
  score; its checkpoint is kept when older ones are pruned.

Checkpoints are written every `trainer.checkpoint_every` iterations and at the end; only the newest
`trainer.keep_checkpoints` complete ones are kept (plus the best). When an evaluation beats the best so
far, the trainers save the evaluated weights before they step, so the best is always a loadable
checkpoint (`mas-async eval CONFIG checkpoint=RUN_DIR eval.pick=best`).

Every checkpoint is written to a temporary name and renamed into place when complete, so a half-written
checkpoint is never seen. The router writes its file only after every trainer has reported its own
checkpoint of that version, so a version with a router file is complete for every policy: that is what
`latest_complete` looks for. Trainer state is saved with torch.save and loaded with weights_only=True
(tensors and plain containers only).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mas_async.disk_full import as_disk_full

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.training.learner import PolicyLearner


STATE = "trainer_state.pt"
"""The file that completes a policy's checkpoint folder (optimiser, scheduler, RNG states, version)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def checkpoint_due(config: Config, version: int) -> bool:
    """Whether the weights of `version` (after iteration version - 1) are checkpointed."""
    every = config.trainer.checkpoint_every
    return version == config.run.iterations or (every > 0 and version % every == 0)


def policy_checkpoint(run_dir: Path, policy: str, version: int) -> Path:
    return run_dir / "checkpoints" / policy / f"v{version:06d}"


def _rng_state(learner: PolicyLearner) -> dict[str, Any]:
    """This process's RNG states: torch's (and its GPU's, for a learner on one), numpy's and Python's."""
    import torch

    state = {
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": json.dumps(learner.rng.bit_generator.state),
        "python_rng": json.dumps(random.getstate()),
    }
    if learner.device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(learner.device)
    return state


def save_policy(run_dir: Path, policy: str, version: int, learner: PolicyLearner) -> Path:
    """Save the policy's checkpoint of `version`. With several trainer ranks every rank calls it (it is
    collective: ZeRO consolidates the optimiser state, every rank's RNG state is gathered) and rank 0
    alone writes the folder."""
    import torch  # here, not at the top: the router imports this module and never needs torch

    from mas_async.lora import ADAPTER_DIR, merged_from_master

    final = policy_checkpoint(run_dir, policy, version)
    optimizer = learner.optimizer_state()
    if learner.distributed is not None:  # this rank's shard, in a file of its own: rank 0 moves it in
        final.parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(optimizer, _shard_file(final, learner.rank, learner.world_size, staged=True))
        optimizer = {"distributed_world_size": learner.world_size}
    ranks = [_rng_state(learner)]
    if learner.dp is not None:
        ranks = learner.dp.gather(ranks[0])  # (also: every rank's shard file is written)
    if learner.rank != 0:
        return final
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if learner.lora is None:
            _save_model(learner.model, tmp, learner.serve_dtype)
        else:  # the merged model (a complete model folder), and the adapters a resumed run starts from
            merged = merged_from_master(learner.lora, learner.trained, learner.serve_dtype)
            _save_model(merged, tmp, learner.serve_dtype)
            learner.model.save_pretrained(tmp / ADAPTER_DIR, safe_serialization=True)
        for name in TOKENIZER_FILES:  # so the checkpoint is a complete model folder (vLLM loads it as one)
            source = Path(learner.model_path) / name
            if source.exists():
                shutil.copy2(source, tmp / name)
        state = {
            "version": version,
            "optimizer": optimizer,
            "scheduler": learner.scheduler.state_dict(),
            **ranks[0],
            "rank_rng": ranks[1:],  # ranks 1.. of a data-parallel trainer, in rank order
        }
        master = learner.master_weights()
        if master is not None:  # the folder holds them rounded to the served dtype
            state["master"] = master
        if learner.scaler is not None:
            state["grad_scaler"] = learner.scaler.state_dict()
        if learner.distributed is not None:
            for rank in range(learner.world_size):
                os.replace(
                    _shard_file(final, rank, learner.world_size, staged=True),
                    tmp / _shard_file(final, rank, learner.world_size).name,
                )
        torch.save(state, tmp / STATE)
        shutil.rmtree(final, ignore_errors=True)  # a leftover of a run killed after this rename
        os.rename(tmp, final)
    except BaseException as error:  # (a full disk, a signal): no half-written folder or shard is left taking space
        full = as_disk_full(error, tmp)  # (before the removal frees the space again)
        shutil.rmtree(tmp, ignore_errors=True)
        if learner.distributed is not None:
            for rank in range(learner.world_size):
                _shard_file(final, rank, learner.world_size, staged=True).unlink(missing_ok=True)
        if full is not None and full is not error:
            raise full from error
        raise
    return final


def _shard_file(final: Path, rank: int, world_size: int, staged: bool = False) -> Path:
    """Where rank `rank` of `world_size` keeps its distributed optimiser shard in the checkpoint folder `final`,
    or (`staged`) beside it, where it writes it before rank 0 moves it in."""
    name = f"optimizer-rank{rank:05d}-of-{world_size:05d}.pt"
    return final.with_name(f".shard-{final.name}-{name}") if staged else final / name


def _atomic_save(obj: Any, path: Path) -> None:
    import torch

    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException as error:
        full = as_disk_full(error, tmp)
        tmp.unlink(missing_ok=True)
        if full is not None and full is not error:
            raise full from error
        raise


def _save_model(model: Any, folder: Path, dtype: Any) -> None:
    """`model.save_pretrained` with its floating-point weights cast to `dtype` (a copy on the host where they
    are kept in another dtype; tied weights stay one tensor), and config.json saying so."""
    import torch

    if all(t.dtype == dtype for t in model.state_dict().values() if t.is_floating_point()):
        model.save_pretrained(folder, safe_serialization=True)
        return
    cast: dict[tuple, torch.Tensor] = {}
    state = {
        name: cast.setdefault(
            (t.data_ptr(), t.shape, t.dtype), t.detach().to("cpu", dtype if t.is_floating_point() else t.dtype)
        )
        for name, t in model.state_dict().items()
    }
    model.save_pretrained(folder, state_dict=state, safe_serialization=True)
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_policy_state(run_dir: Path, policy: str, version: int, learner: PolicyLearner) -> None:
    """Restore optimiser, scheduler and RNG states (the weights come from the folder itself)."""
    import torch

    state: dict[str, Any] = torch.load(policy_checkpoint(run_dir, policy, version) / STATE, weights_only=True)
    if state["version"] != version:
        raise ValueError(f"checkpoint of {policy} at v{version} holds version {state['version']}")
    if "master" in state:
        learner.load_master_weights(state["master"])
    shards = state["optimizer"].get("distributed_world_size") if isinstance(state["optimizer"], dict) else None
    if (shards is None) != (learner.distributed is None):
        raise ValueError(
            f"checkpoint of {policy} at v{version} was saved with trainer.distributed_optimizer="
            f"{str(shards is not None).lower()}: resume with the same setting"
        )
    if learner.distributed is not None:  # any number of ranks: each reads the shards that hold its entries
        folder = policy_checkpoint(run_dir, policy, version)
        read = lambda rank: torch.load(_shard_file(folder, rank, shards), weights_only=True, mmap=True)  # noqa: E731
        learner.distributed.load_shards(read, shards)
    else:
        learner.optimizer.load_state_dict(state["optimizer"])
    learner.scheduler.load_state_dict(state["scheduler"])
    if learner.scaler is not None and "grad_scaler" in state:
        learner.scaler.load_state_dict(state["grad_scaler"])
    if learner.rank > 0:
        if len(state.get("rank_rng", [])) < learner.rank:
            raise ValueError(
                f"checkpoint of {policy} at v{version} holds no RNG state of trainer rank {learner.rank} "
                "(it was saved with fewer ranks)"
            )
        state = state["rank_rng"][learner.rank - 1]
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and learner.device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda_rng"], learner.device)
    learner.rng.bit_generator.state = json.loads(state["numpy_rng"])
    kind, internal, gauss = json.loads(state["python_rng"])
    random.setstate((kind, tuple(internal), gauss))


def save_router(run_dir: Path, version: int, position: dict[str, Any]) -> None:
    folder = run_dir / "checkpoints" / "router"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".tmp-v{version:06d}.json"
    tmp.write_text(json.dumps({"version": version, **position}))
    os.replace(tmp, folder / f"v{version:06d}.json")


def latest_complete(run_dir: Path, policies: list[str]) -> int | None:
    """The newest version checkpointed by the router and by every policy, or None."""
    versions = complete_versions(run_dir, policies)
    return versions[-1] if versions else None


def complete_versions(run_dir: Path, policies: list[str]) -> list[int]:
    """Every version checkpointed by the router and by every policy, oldest first."""
    folder = run_dir / "checkpoints" / "router"
    if not folder.exists():
        return []
    versions = sorted(int(p.stem[1:]) for p in folder.glob("v*.json") if p.stem[1:].isdigit())
    return [v for v in versions if all((policy_checkpoint(run_dir, p, v) / STATE).exists() for p in policies)]


def load_best(run_dir: Path) -> dict[str, Any] | None:
    """{"version": v, "score": s} of the best evaluated checkpoint so far, or None."""
    path = run_dir / "checkpoints" / "best.json"
    return json.loads(path.read_text()) if path.is_file() else None


def save_best(run_dir: Path, version: int, score: float) -> None:
    folder = run_dir / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".tmp-best.json"
    tmp.write_text(json.dumps({"version": version, "score": score}))
    os.replace(tmp, folder / "best.json")


def prune_checkpoints(run_dir: Path, policies: list[str], keep: int, starting: set[int] | None = None) -> list[int]:
    """Delete every complete checkpoint but the newest `keep`, the best and the `starting` versions (those the
    run's processes load when they start: a replica's replacement loads the run's start checkpoint until
    the next whole-run restart); returns the deleted versions. `keep` 0 keeps everything. The router file
    goes first, so a version being deleted is never taken for complete."""
    if keep <= 0:
        return []
    versions = complete_versions(run_dir, policies)
    best = load_best(run_dir)
    protected = set(versions[-keep:]) | ({best["version"]} if best else set()) | (starting or set())
    deleted = [v for v in versions if v not in protected]
    for version in deleted:
        (run_dir / "checkpoints" / "router" / f"v{version:06d}.json").unlink(missing_ok=True)
        for policy in policies:
            shutil.rmtree(policy_checkpoint(run_dir, policy, version), ignore_errors=True)
    return deleted
