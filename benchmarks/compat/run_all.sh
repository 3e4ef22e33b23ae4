#!/usr/bin/env bash
# Do scripts written for Accelerate, Lightning and the HF Trainer run under `gradsync run` as they
# do under torchrun? Builds a separate virtual environment (once), runs every script under both
# launchers (2 processes, Gloo, CPU) plus one broken variant, and prints the results table.
#
#   benchmarks/compat/run_all.sh [--rounds 2] [--only accelerate,lightning,hf_trainer] [--hang-limit 60]
#
# Environment: COMPAT_VENV (default: REPO/.venv-compat), COMPAT_WORKDIR (default:
# REPO/gradsync_runs/compat-<time>), PYTHON (default python3). Takes 5-10 minutes on 2 cores.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VENV="${COMPAT_VENV:-$REPO/.venv-compat}"
WORK="${COMPAT_WORKDIR:-$REPO/gradsync_runs/compat-$(date +%Y%m%d-%H%M%S)}"
PYTHON="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/gradsync" ] || ! "$VENV/bin/python" -c "import accelerate, lightning, transformers" 2>/dev/null; then
    echo "building $VENV" >&2
    "$PYTHON" -m venv "$VENV"
    echo '*' > "$VENV/.gitignore"  # never committed, wherever it lives
    # torch first and pinned: a looser requirement pulls a multi-GB CUDA build. The constraints file
    # keeps every later install from moving it.
    echo "torch==2.13.0" > "$VENV/constraints.txt"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet torch==2.13.0
    "$VENV/bin/pip" install --quiet -c "$VENV/constraints.txt" torch==2.13.0 \
        accelerate lightning transformers numpy psutil rich matplotlib tensorboard scikit-learn
    "$VENV/bin/pip" install --quiet --no-deps -e "$REPO"
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"

mkdir -p "$WORK"
exec "$VENV/bin/python" "$HERE/compat_run.py" --bin "$VENV/bin" --workdir "$WORK" "$@"
