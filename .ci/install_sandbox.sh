#!/usr/bin/env bash
# Install what the sandbox for model-written code needs (docs/sandbox.md): bubblewrap (bwrap) and
# libseccomp (its Python binding, pyseccomp, is a pyproject dependency). Idempotent. Installing needs
# root (apt-get); as another user it says what is missing and exits 0: the code envs then refuse to
# start with a sentence saying what to install, and the sandbox tests skip with that reason.
#
# Usage: bash .ci/install_sandbox.sh
set -euo pipefail
if command -v bwrap >/dev/null 2>&1 && ldconfig -p 2>/dev/null | grep -q libseccomp.so.2; then
    echo "bubblewrap $(bwrap --version | cut -d' ' -f2) and libseccomp are already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "bubblewrap or libseccomp2 missing and not installable here (needs root and apt-get): install them"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends bubblewrap libseccomp2 >/dev/null
echo "installed bubblewrap $(bwrap --version | cut -d' ' -f2)"
