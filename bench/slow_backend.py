"""An hf inference backend that takes long to load, as a large vLLM engine does: it sleeps before it loads
the model (so before its process says Hello). `bench/faults.py` and the fault tests name it
`policies.<p>.backend: bench.slow_backend:SlowHF` and set how long, in the environment every process of
the run inherits: `MAS_ASYNC_TEST_SLOW_FIRST` ({replica index: seconds}, a first start) and
`MAS_ASYNC_TEST_SLOW_REPLACEMENT` (seconds, a replacement of a lost replica, whichever)."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

from mas_async.inference.backends.hf import HFBackend
from mas_async.runtime.actor import DIED_AT_ENV

FIRST_ENV = "MAS_ASYNC_TEST_SLOW_FIRST"
REPLACEMENT_ENV = "MAS_ASYNC_TEST_SLOW_REPLACEMENT"

log = logging.getLogger("mas_async.inference")


class SlowHF(HFBackend):
    def __init__(self, model_path: Any, *, seed: int = 0, **kwargs: Any) -> None:
        replica = seed % 1000  # the server seeds its backend with run.seed * 1000 + its replica index
        if os.environ.get(DIED_AT_ENV):
            seconds = float(os.environ.get(REPLACEMENT_ENV) or 0)
        else:
            seconds = float(json.loads(os.environ.get(FIRST_ENV) or "{}").get(str(replica), 0))
        if seconds:
            log.info("loading slowly: %gs", seconds)
            time.sleep(seconds)
        super().__init__(model_path, seed=seed, **kwargs)
