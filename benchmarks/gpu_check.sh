#!/usr/bin/env bash
# `make gpu-check` without make and without .venv, on a machine whose python3 already has torch
# with CUDA and no network (docs/gpu.md). longboat's dependencies that such a machine lacks
# (pydantic and what it needs) travel as wheels in .whl/, installed into /tmp/site, not into the
# interpreter; longboat itself runs from src/. From the repository root:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD/src && \
#       bash benchmarks/gpu_check.sh
#
# (this script does the same install itself when pydantic is missing and .whl/ is there).
# Arguments go to benchmarks/gpu_check.py (--dry, --deadline-s, --parts). Results are written
# to benchmarks/results/gpu/; when $OUT names a folder, the results and the log are copied there.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${GPU_PYTHON:-python3}"
# With $OUT (a folder the caller collects), the log and each part's results go there as they are
# written, so that a run cut short still leaves what it had.
if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    LOG="${GPU_CHECK_LOG:-$OUT/gpu_check.log}"
    export GPU_CHECK_COPY_TO="$OUT"
else
    LOG="${GPU_CHECK_LOG:-/tmp/gpu_check.log}"
fi
RESULTS=benchmarks/results/gpu
case " $* " in *" --dry "*) GPU_CHECK_DRY=1 ;; esac
if [ "${GPU_CHECK_DRY:-}" = 1 ]; then  # a dry run never writes over the real results
    RESULTS="$(mktemp -d /tmp/gpu-check-dry.XXXXXX)"
fi

if ! "$PY" -c "import pydantic" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
case ":${PYTHONPATH:-}:" in
    *":$PWD/src:"*) ;;
    *) export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" ;;
esac

{
    echo "== $(date -u +%FT%TZ) gpu_check.sh: $PY, PYTHONPATH=$PYTHONPATH"
    nvidia-smi -L 2>&1 || echo "(no nvidia-smi)"
    # What would stop every case at once is said here first, by itself.
    "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', \
torch.__version__, '| CUDA', torch.version.cuda, '| available', torch.cuda.is_available()); \
import longboat.engine; print('longboat imports from', longboat.__file__)" 2>&1
} | tee "$LOG"

STAMP="$(mktemp /tmp/gpu-check-start.XXXXXX)"  # what this run writes is newer
"$PY" benchmarks/gpu_check.py --out "$RESULTS" "$@" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}

if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then
    # Again at the end, whatever the check did: what this run wrote, nothing an earlier run left.
    find "$RESULTS" -maxdepth 1 -name '*.json' -newer "$STAMP" -exec cp -f {} "$OUT"/ \;
    [ "$LOG" -ef "$OUT/gpu_check.log" ] || cp -f "$LOG" "$OUT"/gpu_check.log
    echo "in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
fi
exit "$rc"
