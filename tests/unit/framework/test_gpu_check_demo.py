"""bench/gpu_check.py's demo check: the on-policy figures count only where every trained row measured them."""

from __future__ import annotations

from bench.gpu_check import demo_agreement


def _row(mismatch: int, diff: float, policy: str = "a") -> dict[str, float]:
    return {
        f"policy/{policy}/samples": 8,
        f"policy/{policy}/version_mismatch": mismatch,
        f"policy/{policy}/logprob_abs_diff": diff,
    }


def test_the_worst_of_every_row_and_policy() -> None:
    rows = [{**_row(0, 1e-6), **_row(0, 3e-6, "b")}, {**_row(1, 2e-6), **_row(0, 1e-7, "b")}]
    assert demo_agreement(rows, ["a", "b"]) == (1, 3e-6)


def test_a_row_without_the_figures_is_not_measured_rather_than_zero() -> None:
    rows = [_row(0, 1e-6), {"time/train_s": 1.0, "policy/a/samples": 8}]  # the second stepped and measured neither
    assert demo_agreement(rows, ["a"]) == (None, None)
    rows = [_row(0, 1e-6), {"time/train_s": 1.0, "policy/a/samples": 0}]  # a step without samples measures none
    assert demo_agreement(rows, ["a"]) == (0, 1e-6)
    assert demo_agreement([_row(0, 1e-6)], ["a", "b"]) == (None, None)  # policy b never measured
    assert demo_agreement([], ["a"]) == (None, None)  # nothing trained
    assert demo_agreement([_row(0, 1e-6)], []) == (None, None)  # no policy named
