#!/usr/bin/env bash
# Run the sandbox's tests (tests/unit/sandbox) as an unprivileged user, with the same expectations as the
# root run of `make test`: bubblewrap must isolate programs either way (docs/sandbox.md).
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
runuser -u "$TEST_USER" -- env -i PATH=/usr/local/bin:/usr/bin:/bin HOME="$work" TMPDIR="$work" \
    PYTHONPATH="$checkout" PYTHONDONTWRITEBYTECODE=1 \
    "$interpreter" -m pytest -q -p no:cacheprovider tests/unit/sandbox "$@"
