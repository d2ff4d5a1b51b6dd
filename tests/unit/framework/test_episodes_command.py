"""`mas-async episodes CONFIG`: the first held-out problems played in one process through the real workflow,
env and `Episode`, each move printed (text, action or parse error, reward, what the env showed next) with the
episode's rewards; the weights are the config's models or a run's checkpoint, as `mas-async eval` takes one.

The tiny models write junk; a checkpoint written here makes each mover's greedy reply one of its own moves
(its two move tokens' embeddings opposite and long: one of them always has the largest logit), so that the
moves are valid, the rewards carry something, and the checkpoint's weights show in every reply."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import numpy as np
import pytest

from mas_async.api.env import step_env
from mas_async.api.registry import ENVS, resolve
from mas_async.checkpoint import STATE, policy_checkpoint, save_router
from mas_async.config import dump_config, load_config
from mas_async.held_out import run_problems
from mas_async.launch.cli import main
from mas_async.launch.episodes import without_machine_paths
from mas_async.rollout.nodes import build_nodes
from tests.support.paths import ROOT

CONFIG = ROOT / "configs/plan_path_tiny.yaml"
VERSION = 3
MOVES = {"vertical": ("U", "D"), "horizontal": ("L", "R")}
MACHINE = re.compile(r"(?<![\w.\-/])/(tmp|root|home|work|private|Users)/")


def _episodes(tmp_path: Path, *args: str) -> tuple[str, dict]:
    """The printed episodes and their JSON record, from the command line."""
    out = tmp_path / f"episodes-{len(list(tmp_path.glob('episodes-*.json')))}.json"
    assert main(["episodes", str(CONFIG), "--n", "2", "--json", str(out), *args]) == 0
    return out.read_text(), json.loads(out.read_text())


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A run directory with one complete checkpoint (v3) of both movers, each replying with its own moves."""
    import torch
    from transformers import AutoModelForCausalLM

    from mas_async.model_source import model_cache_dir, resolve_model
    from mas_async.tiny_model import VOCAB

    run = tmp_path_factory.mktemp("run")
    dump_config(load_config(CONFIG), run / "config.yaml")
    base = resolve_model("builtin:tiny-char", model_cache_dir())
    for policy, (first, second) in MOVES.items():
        model = AutoModelForCausalLM.from_pretrained(str(base))
        embeddings = model.get_input_embeddings().weight  # tied: also the output layer
        with torch.no_grad():
            embeddings[VOCAB.index(first)] *= 50.0
            embeddings[VOCAB.index(second)] = -embeddings[VOCAB.index(first)]
        folder = policy_checkpoint(run, policy, VERSION)
        model.save_pretrained(folder)
        torch.save({"version": VERSION}, folder / STATE)
    save_router(run, VERSION, {})
    return run


def test_it_plays_the_held_out_problems_in_order_and_prints_every_move(tmp_path, capsys) -> None:
    _, record = _episodes(tmp_path)
    out = capsys.readouterr().out
    config = load_config(CONFIG)
    _, test = run_problems(resolve(config.env.name, ENVS, "env"), config.env.train_size, config.env.test_size,
                           config.env.options)  # fmt: skip
    assert [e["problem"] for e in record["episodes"]] == test[:2]  # the eval's problems, first ones first
    shown = [json.loads(line.removeprefix("problem: ")) for line in out.splitlines() if line.startswith("problem: ")]
    assert shown == test[:2]
    assert re.findall(r"=== test problem (\d) \(episode seed (\d+)\)", out) == [("0", "0"), ("1", "1000")]
    assert out.splitlines()[0].startswith("# plan_path_tiny: 2 of the run's 64 test problems, greedy; weights: ")
    for episode in record["episodes"]:
        moves = episode["moves"]
        assert [m["agent"] for m in moves] == ["vertical", "horizontal"] * (len(moves) // 2)
        assert len(moves) == 2 * episode["turns"]
        for move in moves:  # the tiny model's junk: each move's text, its parse error, and what came next
            assert f"  wrote:  {move['text']!r}" in out
            assert (move["action"] is None) == (move["parse_error"] is not None)
            assert move["observation"].startswith({"vertical": "V\n", "horizontal": "H\n"}[move["next_agent"]])
        assert set(episode["rewards"]) == {"vertical", "horizontal"}
    assert "parse error: " in out and "env to horizontal: 'H\\n" in out  # control characters escaped
    assert len(re.findall(r"^=== end: success (yes|no), team reward ", out, re.M)) == 2
    assert not MACHINE.search(out) and str(ROOT) not in out


def test_the_rewards_are_the_envs_for_the_recorded_actions(tmp_path, run_dir) -> None:
    _, record = _episodes(tmp_path, "--weights", str(run_dir))
    config = load_config(CONFIG)
    env_cls = resolve(config.env.name, ENVS, "env")
    nodes = build_nodes(config)
    valid = 0
    for episode in record["episodes"]:
        env = env_cls()
        env.reset(seed=episode["seed"], options={"problem": episode["problem"]})
        by_agent: dict[str, list[float]] = {}
        for move in episode["moves"]:
            before = env.clone()
            if move["action"] is not None:
                asyncio.run(step_env(env, move["agent"], move["action"]))
                valid += 1
            local = nodes[move["agent"]].local_reward(before, move["action"], env) if move["action"] else -1.0
            assert move["team_reward"] == (env.team_reward() if move["action"] is not None else 0.0)
            assert move["local_reward"] == local
            assert move["reward"] == config.algorithm.alpha * move["team_reward"] + local
            assert move["observation"] == env.observe(move["next_agent"])
            by_agent.setdefault(move["agent"], []).append(move["reward"])
        assert episode["team_reward"] == env.team_reward()
        assert episode["success"] == env.success()
        assert episode["rewards"] == {agent: float(np.mean(r)) for agent, r in by_agent.items()}
    assert valid > 0


def test_weights_are_the_checkpoints(tmp_path, run_dir, capsys) -> None:
    """Every reply is what the checkpoint's model writes greedily for that prompt, not the base model's."""
    from mas_async.inference.backends.hf import HFBackend
    from mas_async.inference.request import GenerationRequest
    from mas_async.model_source import model_cache_dir, resolve_model
    from mas_async.rollout.chat_prompt import chat_prompt_ids
    from mas_async.rollout.env_worker import load_tokenizer, stop_token_ids

    _, base = _episodes(tmp_path)
    _, trained = _episodes(tmp_path, "--weights", str(run_dir))
    _, by_folder = _episodes(tmp_path, "--weights", str(policy_checkpoint(run_dir, "vertical", VERSION)))
    assert by_folder["episodes"] == trained["episodes"]
    out = capsys.readouterr().out
    assert "weights: vertical checkpoints/vertical/v000003, horizontal checkpoints/horizontal/v000003" in out
    assert trained["version"] == VERSION and base["version"] == 0

    config = load_config(CONFIG)
    env_cls = resolve(config.env.name, ENVS, "env")
    nodes = build_nodes(config)
    backends = {p: HFBackend(policy_checkpoint(run_dir, p, VERSION)) for p in config.policies}
    tokenizer = load_tokenizer(str(resolve_model("builtin:tiny-char", model_cache_dir())))  # (the policies' model's)
    for episode in trained["episodes"]:
        env = env_cls()
        env.reset(seed=episode["seed"], options={"problem": episode["problem"]})
        for move in episode["moves"]:
            assert move["text"] in MOVES[move["agent"]]  # each mover's own move, never the base model's junk
            ids = chat_prompt_ids(tokenizer, nodes[move["agent"]].prompt(env.observe(move["agent"])), {})
            stop = stop_token_ids(tokenizer)
            request = GenerationRequest(ids, max_tokens=config.rollout.max_tokens, greedy=True, stop_token_ids=stop)
            [[completion]] = backends[move["policy"]].generate([request])
            assert tokenizer.decode(completion.token_ids.tolist(), skip_special_tokens=True) == move["text"]
            if move["action"] is not None:
                asyncio.run(step_env(env, move["agent"], move["action"]))
    assert all(m["text"] not in MOVES[m["agent"]] for e in base["episodes"] for m in e["moves"])


def test_what_it_cannot_play_gets_a_sentence(tmp_path, capsys) -> None:
    assert main(["episodes", str(CONFIG), "--weights", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a run directory (no checkpoints/ in it)" in err and "eval.weights.<policy>=FOLDER" in err
    assert main(["episodes", str(ROOT / "configs/examples/openai_movers.yaml")]) == 2  # nothing loaded first
    assert "`mas-async episodes` works on a workflow of nodes" in capsys.readouterr().err


def test_machine_paths_in_env_text_are_hidden() -> None:
    text = 'Traceback:\n  File "/work/main.py", line 4\n  /tmp/x/y.py:3 and 1/2 or a/b; ' + f"{ROOT}/configs/a.yaml"
    shown = without_machine_paths({"observation": text})["observation"]
    assert shown == (
        'Traceback:\n  File "<machine path>/main.py", line 4\n  <machine path>/y.py:3 and 1/2 or a/b; configs/a.yaml'
    )


def test_generate_asks_as_an_env_worker_does() -> None:
    """One request per call: the node's max_tokens when it sets one, else rollout.max_tokens; the run's
    temperature and top_p; the policy's stop tokens."""
    from mas_async.launch.local_policies import LocalPolicies

    class Recording:
        def __init__(self) -> None:
            self.requests = []

        def generate(self, requests):
            self.requests += requests
            return [["completion"] * r.n for r in requests]

    config = load_config(CONFIG, ["rollout.max_tokens=5", "rollout.temperature=0.7"])
    policies = LocalPolicies(config)
    policies.backends["vertical"] = recording = Recording()
    ids = np.array([1, 5, 7], dtype=np.int32)
    assert asyncio.run(policies.generate("vertical", ids, 2, True)) == ["completion"] * 2
    asyncio.run(policies.generate("vertical", ids, 1, False, max_tokens=3))
    first, second = recording.requests
    assert (first.n, first.max_tokens, first.greedy, second.max_tokens, second.greedy) == (2, 5, True, 3, False)
    assert first.temperature == 0.7 and first.top_p == config.rollout.top_p and first.stop_token_ids == [0, 2]
    assert first.prompt_ids.tolist() == [1, 5, 7]
