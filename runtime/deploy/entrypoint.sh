#!/bin/sh
# Entrypoint of the pagecast images (runtime/deploy/Dockerfile, Dockerfile.cpu).
#
#   (no arguments)          serve $PAGECAST_ARTIFACT on 0.0.0.0:$PAGECAST_PORT; when the
#                           artifact is missing and $PAGECAST_MODEL is set, build it first
#   --some-option ...       the same, with extra engine-serve options appended
#   engine-serve ARGS...    engine-serve exactly as given
#   enginebuild ARGS...     build an artifact (run it on the target GPU: docker run --gpus all)
#   build-artifact          only the build-if-missing step (a Kubernetes init container)
#   anything else           run as a command (a shell, for debugging)
#
# Building belongs on the machine that will serve: enginebuild tunes the kernels for the GPU
# it runs on, and `docker build` has no GPU.
set -eu

PAGECAST_ARTIFACT="${PAGECAST_ARTIFACT:-/artifacts/model}"
PAGECAST_PORT="${PAGECAST_PORT:-8000}"
PAGECAST_HOST="${PAGECAST_HOST:-0.0.0.0}"

build_if_missing() {
    if [ -f "$PAGECAST_ARTIFACT/manifest.json" ]; then
        return 0
    fi
    if [ -z "${PAGECAST_MODEL:-}" ]; then
        echo "pagecast-entrypoint: no artifact at $PAGECAST_ARTIFACT (no manifest.json) and PAGECAST_MODEL is not set:" >&2
        echo "  mount a built artifact there, or set PAGECAST_MODEL to a checkpoint directory, .gguf file," >&2
        echo "  Hugging Face cache id or smollm2-135m to build one on this machine first" >&2
        exit 2
    fi
    echo "pagecast-entrypoint: building $PAGECAST_MODEL into $PAGECAST_ARTIFACT (${PAGECAST_GPU:-auto})" >&2
    # A replica sharing the volume may finish the same build first: its artifact is as good.
    # PAGECAST_BUILD_ARGS is split into words on purpose (extra enginebuild options).
    # shellcheck disable=SC2086
    if ! enginebuild --model "$PAGECAST_MODEL" --gpu "${PAGECAST_GPU:-auto}" --output "$PAGECAST_ARTIFACT" \
        ${PAGECAST_BUILD_ARGS:-}; then
        if [ -f "$PAGECAST_ARTIFACT/manifest.json" ]; then
            echo "pagecast-entrypoint: another build wrote $PAGECAST_ARTIFACT meanwhile; using it" >&2
        else
            exit 1
        fi
    fi
}

# Loud, because the defaults make it easy: 0.0.0.0 is every interface of the container, and
# with a published port (docker run -p) anyone who can reach the host can use the model.
warn_if_open() {
    host="$PAGECAST_HOST"
    has_key=""
    [ -n "${PAGECAST_API_KEY:-}" ] && has_key=1
    while [ "$#" -gt 0 ]; do
        case "$1" in
            --api-key) [ -n "${2:-}" ] && has_key=1 ;;
            --api-key=?*) has_key=1 ;;
            --host) host="${2:-}" ;;
            --host=*) host="${1#--host=}" ;;
        esac
        shift
    done
    case "$host" in
        0.0.0.0|::|"[::]"|"") ;;
        *) return 0 ;;
    esac
    if [ -z "$has_key" ]; then
        {
            echo "pagecast-entrypoint: WARNING: ******************************************************************"
            echo "pagecast-entrypoint: WARNING: serving on $host (all interfaces) WITHOUT an API key: anyone who"
            echo "pagecast-entrypoint: WARNING: can reach port $PAGECAST_PORT can use this model and its compute."
            echo "pagecast-entrypoint: WARNING: set PAGECAST_API_KEY (or pass --api-key), or PAGECAST_HOST=127.0.0.1."
            echo "pagecast-entrypoint: WARNING: ******************************************************************"
        } >&2
    fi
}

serve_default() {
    build_if_missing
    warn_if_open "$@"
    exec engine-serve "$PAGECAST_ARTIFACT" --host "$PAGECAST_HOST" --port "$PAGECAST_PORT" "$@"
}

if [ "$#" -eq 0 ]; then
    serve_default
fi

case "$1" in
    -*)
        serve_default "$@"
        ;;
    build-artifact)
        shift
        build_if_missing
        ;;
    *)
        exec "$@"  # engine-serve ..., enginebuild ..., or any command
        ;;
esac
