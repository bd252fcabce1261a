#!/bin/sh
# The image's entry point: `hybridserve ARGS...`, except that `worker` given no --model (and no
# HYBRIDSERVE_WORKER_MODEL) serves the default model from the model volume, writing it there on first
# start. It is written to a temporary folder beside its final place and renamed, so a worker
# stopped half-way leaves no half model, and two workers sharing the volume both end up with one.
set -eu

has_model_flag() {
    for arg in "$@"; do
        case "$arg" in
            --model | --model=*) return 0 ;;
        esac
    done
    return 1
}

if [ "${1:-}" = "worker" ] && [ -z "${HYBRIDSERVE_WORKER_MODEL:-}" ] && ! has_model_flag "$@"; then
    model="${HYBRIDSERVE_HOME:-/models}/default"
    if [ ! -f "$model/config.json" ]; then
        partial="$model.partial-$$"
        rm -rf "$partial"
        echo "writing the default model to $model (first start)" >&2
        hybridserve init-model "$partial"
        mv -T "$partial" "$model" 2>/dev/null || rm -rf "$partial"
    fi
    shift
    set -- worker --model "$model" "$@"
fi
exec hybridserve "$@"
