"""The policy's held-out figures against the env's reference policies, as text.

A held-out success rate means little alone: a policy that always answers the same move can reach one, and
so can random moves. The router plays the env's reference policies (`Env.reference_policies`) once per
run on the same held-out problems (eval/baseline/<name>/...); this module lines the policy's last
evaluation up against them, for the end of `mas-async train` and `mas-async eval` and for the live
display. It reads metrics rows only.
"""

from __future__ import annotations

from typing import Any

from mas_async.metrics import Keys


def baseline_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row that holds the baselines (the run's first evaluation), or None."""
    return next((row for row in rows if Keys.baselines(row)), None)


def last_eval(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last row with a held-out evaluation of the policy, or None."""
    return next((row for row in reversed(rows) if Keys.EVAL_SUCCESS in row), None)


def baselines_line(row: dict[str, Any]) -> str:
    """'random 0.06  always_U_L 0.00  ...  optimal 0.94': each reference policy's held-out success."""
    return "  ".join(f"{name} {rate:.2f}" for name, rate in Keys.baselines(row).items())


def comparison_lines(rows: list[dict[str, Any]], agents: list[str]) -> list[str]:
    """A table of the policy's last held-out evaluation and every reference policy on the same problems:
    team success, and per agent the mean reward and the share of moves judged good (where measured).
    Empty when the run has no baselines or no evaluation."""
    base, policy = baseline_row(rows), last_eval(rows)
    if base is None or policy is None:
        return []
    columns = [("team success", "team_success_rate", ".2f")]
    for agent in agents:
        columns.append((f"reward {agent}", f"reward/{agent}", "+.2f"))
        if any(Keys.baseline(name, Keys.progress_rate(agent)) in base for name in Keys.baselines(base)):
            columns.append((f"progress {agent}", Keys.progress_rate(agent), ".2f"))
    own = {key: policy.get(f"eval/{key}") for _, key, _ in columns} | {"team_success_rate": policy[Keys.EVAL_SUCCESS]}
    entries = [(f"policy (iteration {policy[Keys.ITERATION]})", own)]
    for name in Keys.baselines(base):
        entries.append((f"baseline {name}", {key: base.get(Keys.baseline(name, key)) for _, key, _ in columns}))
    width = max(len(label) for label, _ in entries)
    widths = [max(len(title), 6) for title, _, _ in columns]
    episodes = policy.get(Keys.EVAL_EPISODES)
    lines = [f"held-out problems ({episodes} episodes per row):" if episodes else "held-out problems:"]
    lines.append("  ".join([" " * width] + [title.rjust(w) for (title, _, _), w in zip(columns, widths, strict=True)]))
    for label, values in entries:
        cells = [
            (format(values[key], spec) if isinstance(values[key], (int, float)) else "-").rjust(w)
            for (_, key, spec), w in zip(columns, widths, strict=True)
        ]
        lines.append("  ".join([label.ljust(width), *cells]))
    return lines
