"""The vLLM inference backend: vLLM's async engine behind the `InferenceBackend` interface.

Continuous batching: the InferenceServer may have several `generate` calls in flight
(`concurrent = True`); every request of every call goes to the engine at once and vLLM schedules
them together, step by step. A request with n = K is one vLLM request with n = K, so the K samples
share the prompt's KV blocks. Each completion returns its token ids, the log-prob of every sampled
token under the sampling distribution, log_softmax(logits / temperature) (vLLM's
"processed_logprobs"; what the hf backend returns and the trainer recomputes; with top_p < 1 vLLM
reports the truncated distribution instead, so keep top_p = 1.0 for training), and the weight
version of the engine; a request with `top_logprobs` = k also gets the k most likely tokens of each
position under that distribution, and a request with a `seed` is vLLM's seeded request.

Requests end only at their own stop ids (a stop token is part of the ids) or at max_tokens, exactly
like the hf backend. Weight updates arrive from the trainer's versioned broadcast straight inside
vLLM's worker and are followed by a prefix-cache reset; how is in `vllm_compat.py`, the one module
that knows vLLM's version-specific calls.

vLLM's `AsyncLLM` is bound to the event loop that drives it, while the server calls this backend
both from its own loop (`generate`) and from worker threads (`join_weight_group`, `update_weights`).
So the engine gets a private event loop in a daemon thread, and every call is handed to that loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import gc
import itertools
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from mas_async.inference.backends import vllm_compat
from mas_async.startup import VLLM_START_TIMEOUT_S
from mas_async.wire.samples import Completion

if TYPE_CHECKING:
    from vllm.outputs import CompletionOutput

    from mas_async.inference.request import GenerationRequest
    from mas_async.lora import LoraSetup

_T = TypeVar("_T")

START_TIMEOUT_S = VLLM_START_TIMEOUT_S
"""Bound of starting the engine (vLLM on a CPU takes about a minute; a cold start on a GPU, compile and CUDA
graphs included, several): the router and the trainer wait this much longer for a vLLM server
(`mas_async.startup`), and vLLM's own wait for its engine core is set longer still."""
CLOSE_TIMEOUT_S = 60.0
MARGIN_S = 60.0
"""Beyond the weight group's own bound (`trainer.weight_sync_timeout_s`), for the engine's work around it."""


class EngineTimeout(TimeoutError):
    """A call into the vLLM engine did not finish within its bound (says which call)."""


def _receive_bytes(model_path: str | Path, dtype: str, lora: LoraSetup | None) -> int:
    """The bytes the worker's weight receiver allocates: the model's tensors, or the LoRA adapters only (the
    base weights stay on the host)."""
    if lora is None:
        return vllm_compat.weight_receive_bytes(str(model_path), dtype)
    from mas_async.lora import adapter_manifest
    from mas_async.weights.group import torch_dtype

    dt = torch_dtype(dtype)
    return sum(int(np.prod(shape)) * dt.itemsize for _name, shape, _dtype in adapter_manifest(lora, dt))


def _copy(c: Completion) -> Completion:
    top = c.top_ids is not None and c.top_logprobs is not None
    return Completion(
        c.token_ids.copy(), c.logprobs.copy(), c.version, c.finish_reason,
        c.top_ids.copy() if top else None, c.top_logprobs.copy() if top else None,
    )  # fmt: skip


class VLLMBackend:
    """Serves one policy with vLLM's async engine, started on a local model folder."""

    concurrent = True

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_batch_sequences: int = 512,
        seed: int = 0,
        engine_args: dict[str, Any] | None = None,
        lora: LoraSetup | None = None,
    ) -> None:
        """`engine_args`: extra vLLM `AsyncEngineArgs` fields (e.g. gpu_memory_utilization when a
        trainer shares the GPU), over this backend's defaults. `lora`: `model_path` is the base, and each
        update carries the policy's adapters, merged into the base weights (`vllm_compat.use_lora`).

        On a GPU the weight sync's receive buffers (a copy of the model in `dtype`; with LoRA, of the adapters)
        are counted in the engine's share of the GPU: vLLM is started with a `gpu_memory_utilization` lower
        by their bytes over the GPU's (`vllm_compat.engine_arguments`), so that they fit beside it."""
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be at least 1, got {max_batch_sequences}")
        self.version: int = 0
        self._joined = False
        self._weight_timeout_s = 300.0
        self._in_flight = 0  # generate() batches running on the engine (touched on the engine loop only)
        self._request_ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()

        receive_bytes = _receive_bytes(model_path, dtype, lora)

        async def start() -> Any:
            return vllm_compat.start_engine(
                str(model_path), dtype=dtype, max_num_seqs=max_batch_sequences, seed=seed,
                receive_bytes=receive_bytes, **(engine_args or {}),
            )  # fmt: skip

        try:
            self.engine = self._call(start(), "starting its engine", START_TIMEOUT_S)
        except BaseException:
            self._stop_loop()
            raise
        if lora is not None:
            try:
                self._call(
                    vllm_compat.use_lora(self.engine, lora), "loading the base weights for LoRA", START_TIMEOUT_S
                )
            except BaseException:
                self.close()
                raise
        self.max_model_len = vllm_compat.max_model_len(self.engine)
        # Shut the engine down while the interpreter is still whole (vLLM's own finaliser, run at
        # interpreter teardown, cannot).
        atexit.register(self.close)

    # --- generation ---------------------------------------------------------------------------

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        """Sample every request's n completions; results are in request order, n per request."""
        for i, request in enumerate(requests):
            request.check(i, self.max_model_len)
        future = asyncio.run_coroutine_threadsafe(self._generate(requests), self._loop)
        return await asyncio.wrap_future(future)

    async def _generate(self, requests: list[GenerationRequest]) -> list[list[Completion]]:
        version = self.version
        self._in_flight += 1
        try:
            results = await asyncio.gather(*(self._generate_one(r, version) for r in requests))
        finally:
            self._in_flight -= 1
        if self.version != version:  # the server's UpdateGate makes this impossible
            raise RuntimeError(f"the weights changed from v{version} to v{self.version} during a batch")
        return list(results)

    async def _generate_one(self, request: GenerationRequest, version: int) -> list[Completion]:
        prompt = {"prompt_token_ids": np.asarray(request.prompt_ids, dtype=np.int64).tolist()}
        params = vllm_compat.sampling_params(request)
        final = None
        async for output in self.engine.generate(prompt, params, request_id=f"mas-{next(self._request_ids)}"):
            final = output
        if final is None or len(final.outputs) != params.n:
            raise RuntimeError(f"vLLM returned {0 if final is None else len(final.outputs)} of {params.n} samples")
        outputs = sorted(final.outputs, key=lambda o: o.index)
        completions = [self._completion(o, version, request.top_logprobs) for o in outputs]
        if params.n < request.n:  # greedy: one sample stands for n identical ones
            completions = [completions[0]] + [_copy(completions[0]) for _ in range(request.n - 1)]
        return completions

    @staticmethod
    def _completion(output: CompletionOutput, version: int, top: int = 0) -> Completion:
        if output.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a sample with finish_reason {output.finish_reason!r}")
        completion = Completion(
            token_ids=np.asarray(output.token_ids, dtype=np.int32),
            logprobs=np.asarray(vllm_compat.sampled_logprobs(output), dtype=np.float32),
            version=version,
            finish_reason=output.finish_reason,
        )
        if top:
            ids, values = vllm_compat.top_logprobs(output, top)
            completion.top_ids = np.asarray(ids, dtype=np.int32).reshape(len(ids), top)
            completion.top_logprobs = np.asarray(values, dtype=np.float32).reshape(len(ids), top)
        return completion

    # --- weights ------------------------------------------------------------------------------

    def join_weight_group(
        self,
        *,
        policy: str,
        backend: str,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        generation: int = 0,
        join_timeout_s: float | None = None,
    ) -> None:
        """Join (a generation of) the policy's weight group from inside vLLM's worker (blocking; call from a
        thread); the join is bounded by `join_timeout_s` (default `timeout_s`), each broadcast by `timeout_s`."""
        join_s = timeout_s if join_timeout_s is None else join_timeout_s
        group = dict(
            policy=policy, backend=backend, host=host, port=port, rank=rank, world_size=world_size,
            timeout_s=timeout_s, generation=generation, join_timeout_s=join_s,
        )  # fmt: skip
        self._call(vllm_compat.join_weight_group(self.engine, **group), "joining the weight group", join_s + MARGIN_S)
        self._weight_timeout_s = timeout_s
        self._joined = True

    def update_weights(self, version: int) -> None:
        """Receive the broadcast of `version` inside vLLM's worker, load it, reset the prefix cache,
        then stamp `version` on what follows (blocking; call from a thread while nothing generates).
        A wrong version or manifest raises ValueError and leaves the previous weights in place."""
        if not self._joined:
            raise RuntimeError("update_weights() before join_weight_group()")
        error = self._call(self._update(version), f"loading weights v{version}", self._weight_timeout_s + MARGIN_S)
        if error:
            raise ValueError(error)
        self.version = version

    async def _update(self, version: int) -> str:
        if self._in_flight:
            raise RuntimeError(f"a weight update started while {self._in_flight} batches were generating")
        return await vllm_compat.load_weights(self.engine, version)

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Shut the engine (and its process) down and stop the private loop."""
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            self.engine.shutdown()
            # Let the cancelled output task finish and collect the engine here, on the loop, rather
            # than at interpreter teardown, where its __del__ would run shutdown() a second time.
            del self.engine
            await asyncio.sleep(0.1)
            gc.collect()

        atexit.unregister(self.close)
        try:
            self._call(shutdown(), "shutting down", CLOSE_TIMEOUT_S)
        finally:
            self._stop_loop()

    def _call(self, coro: Coroutine[Any, Any, _T], what: str, timeout_s: float) -> _T:
        """Run `coro` on the engine's loop and wait for it (from any other thread), at most `timeout_s`."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            died = vllm_compat.engine_died(getattr(self, "engine", None))
            raise EngineTimeout(
                f"vLLM did not finish {what} within {timeout_s:g} s"
                + (" (its engine process has died)" if died else "")
            ) from None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
