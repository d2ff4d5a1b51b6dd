#!/usr/bin/env bash
# Run the sandbox's tests (tests/unit/sandbox) as an unprivileged user, with the same expectations as the
# root run of `make test`: bubblewrap must isolate programs either way (docs/sandbox.md); and the tests of
# the sockets' authentication (CURVE keys and handshakes, a replica's direct socket). Then a code-env
# training run as that user (configs/code_tiny.yaml, 2 iterations and the final evaluation), checked:
# every iteration trained on-policy, and the env's reference solution scores 1.0 and its stub 0.0 on the
# held-out problems, so the sandbox ran and judged programs for that user.
#
# The interpreter may live where that user cannot reach it (pyenv in root's home, mode 0700): for the
# test's duration every directory above the interpreter's prefix and the checkout gets the search bit
# (o+x: traversable, still not listable), and each is restored on exit, whatever happens.
#
# Usage (as root): bash .ci/sandbox_as_user.sh [pytest args]   (SANDBOX_TEST_USER=nobody, PYTHON=python3)
set -euo pipefail
cd "$(dirname "$0")/.."
TEST_USER="${SANDBOX_TEST_USER:-nobody}"
PYTHON="${PYTHON:-python3}"
if [ "$(id -u)" -ne 0 ]; then
    echo "not root: the sandbox tests of make test already ran as $(id -un)"
    exit 0
fi
interpreter=$("$PYTHON" -c "import sys; print(sys.executable)")
prefix=$("$PYTHON" -c "import sys; print(sys.base_prefix)")
checkout=$(pwd -P)
work=$(mktemp -d /tmp/mas-sandbox-user-XXXXXX)
chown "$TEST_USER" "$work"
opened=()
restore() {
    for dir in "${opened[@]}"; do chmod o-x "$dir"; done
    rm -rf "$work"
}
trap restore EXIT
for target in "$prefix" "$checkout"; do
    dir=$(dirname "$target")
    while [ "$dir" != "/" ]; do
        if [ "$(( 0$(stat -c %a "$dir") & 1 ))" -eq 0 ]; then
            chmod o+x "$dir"
            opened+=("$dir")
        fi
        dir=$(dirname "$dir")
    done
done
echo "sandbox tests as $TEST_USER (opened for the run: ${opened[*]:-nothing})"
as_user() {
    runuser -u "$TEST_USER" -- env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$work" TMPDIR="$work" \
        PYTHONPATH="$checkout" PYTHONDONTWRITEBYTECODE=1 "$interpreter" "$@"
}
as_user -m pytest -q -p no:cacheprovider tests/unit/sandbox tests/unit/framework/test_curve.py tests/unit/framework/test_direct_socket.py "$@"
echo "a code-env training run as $TEST_USER"
as_user -m mas_async train configs/code_tiny.yaml run.iterations=2 eval.size=4 run.output_dir="$work/run" \
    > "$work/train.out" 2>&1 || { tail -50 "$work/train.out"; exit 1; }
"$PYTHON" - "$work/run" "$TEST_USER" <<'EOF'
import json, pwd, sys
from pathlib import Path
run, user = Path(sys.argv[1]), sys.argv[2]
assert run.stat().st_uid == pwd.getpwnam(user).pw_uid, f"{run} was not written by {user}"
rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
assert [r["iteration"] for r in rows] == [0, 1, 2], [r["iteration"] for r in rows]
for row in rows[:2]:
    assert row["rollout/episodes"] == 4 and row["rollout/dropped"] == 0, row
    for policy in ("coder", "tester"):
        assert row[f"policy/{policy}/version_mismatch"] == 0 and row[f"policy/{policy}/samples"] > 0, row
first = rows[0]  # the baselines are played once, at the first evaluation
reference, stub = (first[f"eval/baseline/{name}/team_success_rate"] for name in ("reference", "stub"))
assert (reference, stub) == (1.0, 0.0), (reference, stub)
assert first["eval/baseline/reference/episodes"] == 4, first
print(f"code-env run as {user}: 2 iterations on-policy; held-out team success: reference {reference}, stub {stub}, "
      f"policy {rows[2]['eval/team_success_rate']}")
EOF
