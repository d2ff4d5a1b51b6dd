"""`check_env`: validate that an env class keeps the `mas_async.api.env.Env` contract before anyone trains on it.

`check_env(MyEnv, **problem_options)` raises `EnvCheckError` naming the env and the failed property, or
returns a `CheckReport` listing what it checked and what it had to skip. The tests run it over every
registered env (tests/unit/test_check_env.py); run it on your own env the same way:

    from envs.check import check_env
    report = check_env(MyEnv, sizes=[5])      # keyword arguments go to MyEnv.problems()
    print(report)                             # "my_pkg.envs:MyEnv: checked 12 properties, skipped none"

What it checks:
- API: `possible_agents` is a non-empty list of distinct strings; after `reset(options={"problem": p})`
  `terminations` and `truncations` map every agent to a bool (all False on a fresh problem), `infos` maps
  every agent to a dict, `observe(agent)` is a string of at most `MAX_OBSERVATION_CHARS` characters from
  the env's charset (below), `team_reward()` is a finite number in [0, 1] and `success()` a bool.
- problems: `problems(split, count, **options)` returns `count` plain dicts (fewer only when a dataset
  holds fewer) that survive a JSON round trip unchanged (they travel in messages), the same ones on
  every call (same seed, same problem); the "train" and "test" splits share no problem by content (its
  seed aside: `problem_content`) and no "seed" value, and an unknown split is a ValueError.
- determinism: two envs reset on the same problem observe the same thing, and stay equal step by step
  under the same actions.
- clones: `clone()` is a new object that observes the same thing, shares no per-agent dict with the
  original, and stepping either one leaves the other exactly as it was.
- reference policies: `reference_policies()` is a dict of callables whose names can name a metric (no
  "/" or spaces); each one, played for every agent in turn, only plays actions that `step` accepts, and
  `move_quality` judges each of its moves with a bool or None.

What it reports (`CheckReport.held_out`, `HeldOutStates`): of the states reachable from the test
problems, how many are also reachable from the train problems. The splits are disjoint by content, but
a small grid's states are not: a held-out problem whose start is a training episode's fourth state asks
nothing new. A state is what every agent observes (the tuple of `observe(agent)`); the states reachable
from a problem are those `action_examples` reach in at most `depth` actions, any agent acting next,
`limit` at most per problem (bounded enumeration: `bounded` says a bound was hit). An env that runs
programs is judged on its start states only (a step would be a sandbox run). check_env reports it for
its own few problems; for a run's problems (its `env.train_size` training problems and its held-out
ones, `mas_async.held_out`), the framework's command:

    python -m mas_async.launch.env_check configs/plan_path_smollm2_grid.yaml        # [overrides...]

What an env may add for it (both optional; an env without them is still checked, minus what they enable):
- `action_examples(agent) -> list`: actions `agent` may play in the current state, [] when it cannot act
  now (e.g. a placer before a cell is chosen). check_env steps the env with them (chosen by a seeded
  RNG, agents in `possible_agents` order, skipping those with no example) for the determinism and clone
  checks; without it those stepping checks are skipped and listed in `CheckReport.skipped`. An action
  that is not valid must raise ValueError from `step` before changing anything.
- `observation_charset: str`: the characters its observations may use; default `DEFAULT_CHARSET`
  (printable ASCII). The PettingZoo adapter (envs/pettingzoo_adapter.py) declares its `Text` spaces with it.
"""

from __future__ import annotations

import copy
import json
import math
import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mas_async.api import Env, problem_content

DEFAULT_CHARSET = string.printable  # digits, ASCII letters, punctuation and whitespace
MAX_OBSERVATION_CHARS = 1 << 17


class EnvCheckError(Exception):
    """An env breaks its contract; the message names the env and the property."""


@dataclass
class HeldOutStates:
    """How many of the states reachable from held-out problems are reachable from training problems too
    (see the module docstring)."""

    states: int
    """Distinct states reachable from the held-out problems."""
    seen: int
    """Of those, the states also reachable from some training problem."""
    starts: int
    """Distinct start states of the held-out problems."""
    starts_seen: int
    """Of those, the start states reachable from some training problem."""
    train: int
    test: int
    depth: int
    bounded: bool
    """Whether some problem had more than `limit` states within `depth` actions (its count is a floor)."""

    @property
    def share(self) -> float:
        return self.seen / self.states if self.states else 0.0

    def __str__(self) -> str:
        bound = ", bounded" if self.bounded else ""
        return (
            f"held-out states reachable from training problems: {self.seen} of {self.states} ({self.share:.0%}), "
            f"start states {self.starts_seen} of {self.starts} ({self.test} held-out and {self.train} training "
            f"problems, {self.depth} actions deep{bound})"
        )


@dataclass
class CheckReport:
    """What `check_env` verified for one env, and what it could not (with the reason), and how many held-out
    states training problems reach."""

    env: str
    checked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    held_out: HeldOutStates | None = None

    def __str__(self) -> str:
        skipped = "; ".join(self.skipped) or "none"
        held_out = f"; {self.held_out}" if self.held_out is not None else ""
        return f"{self.env}: checked {len(self.checked)} properties, skipped {skipped}{held_out}"


def observation_charset(env: Env | type[Env]) -> str:
    """The characters `env`'s observations may use (its `observation_charset`, else printable ASCII)."""
    return getattr(env, "observation_charset", DEFAULT_CHARSET)


def check_env(
    env_cls: type[Env],
    *,
    count: int = 3,
    steps: int = 8,
    seed: int = 0,
    action_examples: Callable[[Env, str], list[Any]] | None = None,
    **options: Any,
) -> CheckReport:
    """Check `env_cls` (see the module docstring); `options` are passed to `env_cls.problems`.

    `action_examples(env, agent)` stands in for the env's own method of that name, for an env that has
    none; `count` problems per split are generated and up to `steps` steps played on two of them."""
    report = CheckReport(f"{env_cls.__module__}:{env_cls.__qualname__}")
    checker = _Checker(env_cls, report, action_examples)
    agents = checker.possible_agents()
    checker.documentation(agents)
    problems = checker.problems(count, options)
    for problem in problems:
        env = checker.reset(problem, agents)
        twin = checker.reset(problem, agents)
        checker.same(env, twin, agents, "determinism", "two envs reset on the same problem differ")
        checker.clone_independence(env, agents, "a fresh clone")
        if checker.examples is not None:
            checker.play(env, twin, agents, steps, random.Random(seed))
        env.close()
        twin.close()
    if checker.examples is None:
        report.skipped.append("stepping (no action_examples)")
    checker.reference_policies(problems, agents, steps, seed)
    if checker.examples is not None:
        train, test = checker.splits["train"], checker.splits["test"]
        report.held_out = held_out_states(env_cls, train, test, action_examples=checker.examples, depth=steps)
        report.checked.append("held-out states")
    report.checked.append("close")
    return report


def state(env: Env, agents: list[str]) -> tuple[str, ...]:
    """What every agent observes: the state as the agents know it."""
    return tuple(str(env.observe(agent)) for agent in agents)


def reachable_states(
    env_cls: type[Env],
    problem: dict[str, Any],
    examples: Callable[[Env, str], list[Any]],
    depth: int,
    limit: int,
) -> tuple[tuple[str, ...], set[tuple[str, ...]], bool]:
    """`problem`'s start state, the states `examples` reach from it in at most `depth` actions (any agent
    acting next; breadth first), and whether `limit` states stopped the search first."""
    env = env_cls()
    env.reset(seed=problem.get("seed"), options={"problem": copy.deepcopy(problem)})
    agents = list(env.possible_agents)
    start = state(env, agents)
    seen, frontier = {start}, [env]
    for _ in range(depth):
        following = []
        for current in frontier:
            if current.done:
                continue
            for agent in agents:
                for action in examples(current, agent):
                    after = current.clone()
                    after.step(agent, copy.deepcopy(action))
                    key = state(after, agents)
                    if key in seen:
                        continue
                    if len(seen) >= limit:
                        env.close()
                        return start, seen, True
                    seen.add(key)
                    following.append(after)
        frontier = following
        if not frontier:
            break
    env.close()
    return start, seen, False


def held_out_states(
    env_cls: type[Env],
    train: list[dict[str, Any]],
    test: list[dict[str, Any]],
    *,
    action_examples: Callable[[Env, str], list[Any]] | None = None,
    depth: int = 8,
    limit: int = 256,
) -> HeldOutStates:
    """How many states reachable from the `test` problems are reachable from the `train` problems (see the
    module docstring); an env that runs programs is judged on its start states only (depth 0)."""
    examples = action_examples or getattr(env_cls, "action_examples", None)
    if examples is None:
        raise EnvCheckError(f"held-out states of {env_cls.__name__}: it has no action_examples to step with")
    depth = 0 if env_cls.runs_code else depth
    bounded, trained = False, set()
    for problem in train:
        _, states, hit = reachable_states(env_cls, problem, examples, depth, limit)
        trained |= states
        bounded |= hit
    starts, held = set(), set()
    for problem in test:
        start, states, hit = reachable_states(env_cls, problem, examples, depth, limit)
        starts.add(start)
        held |= states
        bounded |= hit
    return HeldOutStates(
        states=len(held), seen=len(held & trained), starts=len(starts), starts_seen=len(starts & trained),
        train=len(train), test=len(test), depth=depth, bounded=bounded,
    )  # fmt: skip


class _Checker:
    def __init__(
        self, env_cls: type[Env], report: CheckReport, examples: Callable[[Env, str], list[Any]] | None
    ) -> None:
        self.env_cls = env_cls
        self.report = report
        if examples is None and callable(getattr(env_cls, "action_examples", None)):
            examples = env_cls.action_examples
        self.examples = examples
        self.splits: dict[str, list[dict[str, Any]]] = {}

    def fail(self, prop: str, detail: str) -> EnvCheckError:
        return EnvCheckError(f"check_env({self.report.env}): {prop}: {detail}")

    def passed(self, prop: str) -> None:
        if prop not in self.report.checked:
            self.report.checked.append(prop)

    def documentation(self, agents: list[str]) -> None:
        """Every agent's action and the rewards said (`Env.actions`, `Env.rewards`): what `mas-async envs` shows."""
        cls = self.env_cls
        if not cls.actions and not cls.rewards and not cls.info_keys:
            self.report.skipped.append("documentation (no actions, rewards or info_keys declared)")
            return
        missing = [a for a in agents if not cls.actions.get(a)]
        if missing:
            raise self.fail("documentation", f"actions must say what each agent's action is; none for {missing}")
        if not cls.rewards:
            raise self.fail("documentation", "rewards must say what team_reward() is and when an episode ends")
        self.passed("documentation")

    def documented_infos(self, env: Env, agents: list[str], when: str) -> None:
        if not self.env_cls.info_keys:
            return
        for agent in agents:
            unsaid = sorted(set(env.infos[agent]) - set(self.env_cls.info_keys.get(agent, {})))
            if unsaid:
                raise self.fail("documentation", f"after {when}, infos[{agent!r}] holds {unsaid}, not in info_keys")
        self.passed("infos documented")

    def possible_agents(self) -> list[str]:
        agents = self.env_cls().possible_agents
        if not isinstance(agents, list) or not agents or not all(isinstance(a, str) and a for a in agents):
            raise self.fail("possible_agents", f"must be a non-empty list of agent names, got {agents!r}")
        if len(set(agents)) != len(agents):
            raise self.fail("possible_agents", f"names must be distinct, got {agents!r}")
        self.passed("possible_agents")
        return list(agents)

    def problems(self, count: int, options: dict[str, Any]) -> list[dict[str, Any]]:
        splits = {}
        for split in ("train", "test"):
            first = self.env_cls.problems(split, count, **options)
            if not isinstance(first, list) or not 1 <= len(first) <= count:
                # A dataset smaller than `count` may return all it has, but never nothing or more.
                raise self.fail("problems", f"problems({split!r}, {count}) must return a list of 1 to {count} dicts")
            for index, problem in enumerate(first):
                if not isinstance(problem, dict):
                    raise self.fail("problems", f"{split} problem {index} is a {type(problem).__name__}, not a dict")
                try:
                    plain = json.loads(json.dumps(problem))
                except (TypeError, ValueError) as e:
                    raise self.fail("problems", f"{split} problem {index} is not JSON-able: {e}") from None
                if plain != problem:
                    raise self.fail("problems", f"{split} problem {index} changes in a JSON round trip (tuples?)")
            if self.env_cls.problems(split, count, **options) != first:
                raise self.fail("problem determinism", f"two calls of problems({split!r}, {count}) differ")
            splits[split] = first
        self.passed("problems are plain JSON dicts")
        self.passed("problem determinism")
        train = {problem_content(p) for p in splits["train"]}
        if any(problem_content(p) in train for p in splits["test"]):
            raise self.fail(
                "split disjointness", "a problem (its seed aside) appears in both the train and the test split"
            )
        seeds = [{p["seed"] for p in splits[s] if "seed" in p} for s in ("train", "test")]
        if seeds[0] & seeds[1]:
            raise self.fail("split disjointness", f"train and test share seeds {sorted(seeds[0] & seeds[1])[:5]}")
        try:
            self.env_cls.problems("no-such-split", 1, **options)
        except ValueError:
            pass
        else:
            raise self.fail("split disjointness", "problems('no-such-split', 1) must raise ValueError")
        self.passed("split disjointness")
        self.splits = splits
        return splits["train"][:1] + splits["test"][:1]

    def reset(self, problem: dict[str, Any], agents: list[str]) -> Env:
        env = self.env_cls()
        env.reset(seed=problem.get("seed"), options={"problem": copy.deepcopy(problem)})
        self.valid_state(env, agents, "reset")
        if any(env.terminations.values()) or any(env.truncations.values()):
            raise self.fail("reset", "terminations and truncations must all be False on a fresh problem")
        return env

    def valid_state(self, env: Env, agents: list[str], when: str) -> None:
        for name in ("terminations", "truncations", "infos"):
            value = getattr(env, name, None)
            if not isinstance(value, dict) or set(value) != set(agents):
                raise self.fail("api", f"after {when}, {name} must be a dict keyed by {agents}, got {value!r}")
        for agent in agents:
            for name in ("terminations", "truncations"):
                if not isinstance(getattr(env, name)[agent], bool):
                    raise self.fail("api", f"after {when}, {name}[{agent!r}] must be a bool")
            if not isinstance(env.infos[agent], dict):
                raise self.fail("api", f"after {when}, infos[{agent!r}] must be a dict")
            self.observation(env, agent, when)
        self.documented_infos(env, agents, when)
        reward = env.team_reward()
        if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
            raise self.fail("team_reward", f"after {when}, team_reward() must be a finite number, got {reward!r}")
        if not 0.0 <= reward <= 1.0:
            raise self.fail("team_reward", f"after {when}, team_reward() must lie in [0, 1], got {reward!r}")
        if not isinstance(env.success(), bool):
            raise self.fail("api", f"after {when}, success() must be a bool")
        self.passed("api")
        self.passed("team_reward in [0, 1]")

    def observation(self, env: Env, agent: str, when: str) -> str:
        obs = env.observe(agent)
        if not isinstance(obs, str):
            raise self.fail("observe", f"after {when}, observe({agent!r}) is a {type(obs).__name__}, not a str")
        bad = sorted(set(obs) - set(observation_charset(env)))
        if bad:
            raise self.fail(
                "observe", f"after {when}, observe({agent!r}) uses {bad[:5]} outside the env's observation_charset"
            )
        if len(obs) > MAX_OBSERVATION_CHARS:
            raise self.fail("observe", f"after {when}, observe({agent!r}) is longer than {MAX_OBSERVATION_CHARS}")
        self.passed("observe")
        return obs

    def snapshot(self, env: Env, agents: list[str]) -> tuple:
        observations = tuple(env.observe(agent) for agent in agents)
        dicts = copy.deepcopy((env.terminations, env.truncations, env.infos))
        return observations, env.team_reward(), dicts

    def same(self, env: Env, other: Env, agents: list[str], prop: str, detail: str) -> None:
        if self.snapshot(env, agents) != self.snapshot(other, agents):
            raise self.fail(prop, detail)
        self.passed(prop)

    def clone_independence(self, env: Env, agents: list[str], when: str) -> None:
        clone = env.clone()
        if clone is env or type(clone) is not type(env):
            raise self.fail("clone", f"{when}: clone() must return a new {type(env).__name__}")
        self.same(env, clone, agents, "clone", f"{when}: the clone does not observe what the original does")
        for name in ("terminations", "truncations", "infos"):
            if getattr(env, name) is getattr(clone, name):
                raise self.fail("clone independence", f"{when}: the clone shares the {name} dict with the original")
        self.passed("clone independence")

    def reference_policies(self, problems: list[dict[str, Any]], agents: list[str], steps: int, seed: int) -> None:
        policies = self.env_cls.reference_policies()
        if not isinstance(policies, dict):
            raise self.fail("reference policies", f"reference_policies() must return a dict, got {policies!r:.80}")
        for name, policy in policies.items():
            if not isinstance(name, str) or not name or "/" in name or any(ch.isspace() for ch in name):
                raise self.fail("reference policies", f"name {name!r} must be a non-empty string without '/' or spaces")
            if not callable(policy):
                raise self.fail("reference policies", f"{name!r} is not callable")
            for problem in problems:
                env, rng = self.reset(problem, agents), random.Random(seed)
                for turn in range(steps):
                    agent = agents[turn % len(agents)]
                    if env.done:
                        break
                    if self.examples is not None and not self.examples(env, agent):
                        continue  # the agent cannot act now (a placer before a cell is chosen)
                    action = policy(env, agent, rng)
                    after = env.clone()
                    try:
                        after.step(agent, copy.deepcopy(action))
                    except ValueError as e:
                        raise self.fail(
                            "reference policies", f"{name!r} played {action!r:.60} for {agent!r}: {e}"
                        ) from None
                    quality = env.move_quality(agent, action, after)
                    if quality is not None and not isinstance(quality, bool):
                        raise self.fail(
                            "move_quality", f"judged {name!r}'s move {action!r:.60} {quality!r}, not a bool"
                        )
                    env = after  # (clones may share resources: only the last one is closed)
                env.close()
        if policies:
            self.passed("reference policies")

    def play(self, env: Env, twin: Env, agents: list[str], steps: int, rng: random.Random) -> None:
        turn = 0
        for _ in range(steps):
            if env.done:
                break
            for offset in range(len(agents)):
                agent = agents[(turn + offset) % len(agents)]
                examples = list(self.examples(env, agent))
                if examples:
                    break
            else:
                break  # nobody can act now
            turn = agents.index(agent) + 1
            action = examples[rng.randrange(len(examples))]
            when = f"step({agent!r}, {action!r})"
            before = self.snapshot(env, agents)
            clone = env.clone()
            clone.step(agent, copy.deepcopy(action))
            if self.snapshot(env, agents) != before:
                raise self.fail("clone independence", f"{when} on a clone changed the original")
            self.valid_state(clone, agents, when)
            stepped_clone = self.snapshot(clone, agents)
            env.step(agent, copy.deepcopy(action))
            if self.snapshot(clone, agents) != stepped_clone:
                raise self.fail("clone independence", f"{when} on the original changed its clone")
            twin.step(agent, copy.deepcopy(action))
            self.valid_state(env, agents, when)
            self.same(env, clone, agents, "determinism", f"{when} gave different states on the env and its clone")
            self.same(env, twin, agents, "determinism", f"{when} gave different states on two equal envs")
        self.passed("stepping")
