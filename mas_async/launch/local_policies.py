"""A run's policies served inside one process, for commands that play episodes without a deployment.

`mas-async episodes` plays the real workflow on the real env through the real `Episode`; only the requests
are answered here instead of by inference servers. Each policy's model is loaded by `HFBackend`, the
transformers engine of the CPU inference servers, from the weights `mas-async eval` would serve: the
policy's model (`policies.<p>.model`), or a checkpoint (`eval.checkpoint=RUN_DIR`, `eval.pick`,
`eval.weights.<p>=FOLDER`: `mas_async.launch.launcher.eval_weights`; a LoRA policy's checkpoint folder
holds the merged model, and its untrained adapters change nothing). Policies that read the same folder in
the same dtype share one loaded model. The tokenizers and stop tokens are the env worker's (from the
policy's model folder), and `generate` builds the request an env worker sends (`rollout.max_tokens` unless
the node sets its own, `rollout.temperature`, `rollout.top_p`), with the signature `Episode` calls.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mas_async.checkpoint import policy_checkpoint
from mas_async.config import ConfigError

if TYPE_CHECKING:
    from mas_async.config import Config
    from mas_async.inference.backends.hf import HFBackend
    from mas_async.wire.samples import Completion

VERSION_FOLDER = re.compile(r"v(\d{6})")
"""The name of a policy's checkpoint folder of one version (`mas_async.checkpoint.policy_checkpoint`)."""


def take_weights(config: Config, weights: str | None) -> None:
    """Point `config.eval` at the checkpoint `weights` names, as `mas-async eval` takes one: a run directory
    (its latest complete checkpoint, or with `eval.pick=best` its best), its `checkpoints/` folder, or one
    version's folder of any policy, RUN_DIR/checkpoints/<policy>/vNNNNNN (that version of every policy).
    Anything else is a ConfigError saying what is accepted."""
    if weights is None:
        return
    folder = Path(weights)
    version = VERSION_FOLDER.fullmatch(folder.name)
    if folder.name == "checkpoints" and (folder / "router").is_dir():
        folder = folder.parent
    if (folder / "checkpoints").is_dir():
        config.eval.checkpoint = str(folder)
        return
    if version and folder.parent.parent.name == "checkpoints" and (folder / "config.json").is_file():
        from mas_async.launch.launcher import check_checkpoint_matches

        run_dir = folder.parent.parent.parent
        check_checkpoint_matches(config, run_dir)
        for policy in config.policies:
            path = policy_checkpoint(run_dir, policy, int(version.group(1)))
            if not (path / "config.json").is_file():
                raise ConfigError(
                    f"--weights={weights}: the run holds no checkpoint of policy {policy!r} at v{version.group(1)}"
                )
            config.eval.weights.setdefault(policy, str(path))
        return
    raise ConfigError(
        f"--weights={weights}: not a run directory (no checkpoints/ in it) nor a policy's checkpoint folder "
        "RUN_DIR/checkpoints/<policy>/vNNNNNN; one model folder for one policy: eval.weights.<policy>=FOLDER"
    )


def weights_label(path: str) -> str:
    """A checkpoint folder as a reader names it, with no machine path: "checkpoints/<policy>/vNNNNNN" for a
    run's checkpoint, else the folder's last part."""
    parts = Path(path).parts
    if len(parts) >= 3 and parts[-3] == "checkpoints" and VERSION_FOLDER.fullmatch(parts[-1]):
        return "/".join(parts[-3:])
    return parts[-1] if parts else path


class LocalPolicies:
    """Every policy of `config` loaded in this process: tokenizers, models, and the episode's `generate`."""

    def __init__(self, config: Config) -> None:
        import torch

        from mas_async.inference.backends.hf import HFBackend
        from mas_async.launch.launcher import eval_weights
        from mas_async.model_source import model_cache_dir, resolve_model
        from mas_async.rollout.env_worker import load_tokenizer, stop_token_ids

        self.config = config
        weights, version = eval_weights(config)
        self.version = version
        """The checkpoint version served (0: the policies' models)."""
        self.sources: dict[str, str] = {}
        """policy -> what its weights are, as a reader names them (its model spec, or its checkpoint folder)."""
        self.tokenizers: dict[str, Any] = {}
        self.stop_ids: dict[str, list[int]] = {}
        self.backends: dict[str, HFBackend] = {}
        loaded: dict[tuple[str, str, str], HFBackend] = {}
        for policy, spec in config.policies.items():
            model_path = str(resolve_model(spec.model, model_cache_dir(), spec.revision, policy=policy))
            self.tokenizers[policy] = load_tokenizer(model_path)
            self.stop_ids[policy] = stop_token_ids(self.tokenizers[policy])
            path = weights.get(policy, model_path)
            self.sources[policy] = weights_label(path) if policy in weights else spec.model
            device = spec.servers_on() or ("cuda" if torch.cuda.is_available() else "cpu")  # (vLLM's: none)
            key = (path, spec.dtype, device)
            if key not in loaded:
                loaded[key] = HFBackend(
                    path, dtype=spec.dtype, device=device, max_batch_sequences=spec.max_batch_sequences,
                    seed=config.run.seed * 1000,
                )  # fmt: skip
                loaded[key].version = version
            self.backends[policy] = loaded[key]

    async def generate(
        self, policy: str, prompt_ids: np.ndarray, n: int, greedy: bool, *, max_tokens: int | None = None
    ) -> list[Completion]:
        """n completions of `prompt_ids` by `policy`'s model, from one request (`Episode`'s generate). It runs
        here, on the event loop: the episodes play one at a time, and nothing else waits on the loop."""
        from mas_async.inference.request import GenerationRequest

        rollout = self.config.rollout
        request = GenerationRequest(
            prompt_ids=np.asarray(prompt_ids, dtype=np.int32), n=n,
            max_tokens=rollout.max_tokens if max_tokens is None else max_tokens, temperature=rollout.temperature,
            top_p=rollout.top_p, greedy=greedy, stop_token_ids=self.stop_ids[policy],
        )  # fmt: skip
        return self.backends[policy].generate([request])[0]
