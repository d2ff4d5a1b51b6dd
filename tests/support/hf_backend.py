"""The transformers backend as its tests use it: the tiny model with sharpened weights, and a few prompts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from mas_async.inference.backends.hf import HFBackend


def sharp_backend(model_dir: Path) -> HFBackend:
    """A backend whose weights are scaled up so that outputs are far from uniform and vary."""
    torch.set_num_threads(1)
    backend = HFBackend(model_dir, seed=0)
    sharp = [
        (n, p.detach() * (1.0 if n.endswith("norm.weight") else 30.0)) for n, p in backend.model.named_parameters()
    ]
    backend.load_weights(sharp)
    return backend


def prompt_ids(length: int, seed: int) -> np.ndarray:
    """`length` random token ids of the tiny model's vocabulary."""
    return np.random.default_rng(seed).integers(7, 51, size=length).astype(np.int32)


PROMPTS = [prompt_ids(3, 0), prompt_ids(11, 1), prompt_ids(30, 2)]
