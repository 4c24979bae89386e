#!/usr/bin/env bash
# One nightly evaluation step: make sure the stack is up, submit the eval file, wait for the
# batch, and keep its results. The exit code is `conveyor submit`'s: 0 completed, 3 failed
# validation, 4 expired, 5 cancelled, 6 more failed requests than MAX_FAILED, 1 API unreachable.
#
# The API wants a key: CONVEYOR_API_KEY (made once with
#   docker compose run --rm migrate conveyor keys create --name nightly-eval).
# A re-run on the same day (the pipeline was restarted, the host rebooted) attaches to that
# day's batch instead of submitting it again: the idempotency key names the day.
# With REUSE=1 (the default) a line that earlier nights answered under the same model
# fingerprint, unchanged, is answered from their results (`--reuse`): only edited and new lines
# are computed, and the summary line says how many were reused. REUSE=0 computes everything.
# Beside results.jsonl, results.jsonl.meta.json says what produced it: the batch's id and each
# worker's model fingerprint, engine settings and sampling defaults.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"

STAMP="${STAMP:-$(date +%F)}"
EVAL_FILE="${EVAL_FILE:-$here/eval.jsonl}"
OUT_DIR="${OUT_DIR:-$here/results/$STAMP}"
mkdir -p "$OUT_DIR"

if [ "${START_STACK:-1}" = 1 ]; then
    # idempotent: starts what is not running, leaves the rest alone
    docker compose --project-directory "$here/../.." up -d --build
fi

reuse=()
if [ "${REUSE:-1}" = 1 ]; then
    reuse=(--reuse)
fi

exec conveyor submit "$EVAL_FILE" "${reuse[@]}" \
    --model "${SERVED_MODEL:-qwen3}" \
    --idempotency-key "nightly-eval-$STAMP" \
    --wait --wait-api 600 \
    -o "$OUT_DIR/results.jsonl" \
    --errors "$OUT_DIR/errors.jsonl" \
    --max-failed "${MAX_FAILED:-0}"
