#!/bin/sh
# The image's entry point: `hybridserve ARGS...`, except for `worker`:
# - given no model (no --model, no HYBRIDSERVE_WORKER_MODEL), it serves the default model from the
#   model volume, writing it there on first start. It is written to a temporary folder beside its
#   final place and renamed, so a worker stopped half-way leaves no half model, and two workers
#   sharing the volume both end up with one.
# - given a Hugging Face repo id (ORG/NAME, not a path), it first fills the hub cache with
#   `hybridserve download` (HF_HUB_CACHE, HF_TOKEN and HYBRIDSERVE_WORKER_REVISION as set), then
#   starts the worker offline, so it serves exactly what was downloaded. Already offline
#   (HF_HUB_OFFLINE=1, e.g. after an init container downloaded it), it starts at once.
set -eu

flag_arg() {  # flag_arg NAME ARGS...: the value of --NAME V or --NAME=V in ARGS; fails when absent
    name="$1"
    shift
    while [ $# -gt 0 ]; do
        case "$1" in
            "--$name") echo "${2:-}"; return 0 ;;
            "--$name="*) echo "${1#--"$name"=}"; return 0 ;;
        esac
        shift
    done
    return 1
}

is_repo_id() {  # ORG/NAME that is not a path here
    case "$1" in
        /* | ./* | ../* | ~*) return 1 ;;
        */*/*) return 1 ;;
        ?*/?*) [ ! -e "$1" ] ;;
        *) return 1 ;;
    esac
}

if [ "${1:-}" = "worker" ]; then
    model="$(flag_arg model "$@" || echo "${HYBRIDSERVE_WORKER_MODEL:-}")"
    if [ -z "$model" ]; then
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
    elif is_repo_id "$model" && [ "${HF_HUB_OFFLINE:-0}" != "1" ]; then
        revision="$(flag_arg revision "$@" || echo "${HYBRIDSERVE_WORKER_REVISION:-}")"
        echo "downloading $model${revision:+ at $revision} into the hub cache" >&2
        hybridserve download "$model" ${revision:+--revision "$revision"} >&2
        export HF_HUB_OFFLINE=1
    fi
fi
exec hybridserve "$@"
