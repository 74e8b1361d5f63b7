#!/usr/bin/env bash
# Build (or push) the two images with whichever builder this machine has. Called by `make images`
# and `make push`; every knob comes from the environment:
#   BUILDER   docker | podman | buildah (default: the first one found)
#   BASE      the base image of both Dockerfiles (default python:3.11-slim)
#   TAG       the images' tag (default: the project's version)
#   CA_BUNDLE a CA bundle mounted over the build's system bundle (TLS-intercepting proxies)
#   WHEELS    a local wheel folder offered to pip (e.g. the CPU torch wheel)
#   REGISTRY  for `push`: where the images go (REGISTRY/gpu-watchdog-inference:TAG, ...)
#   STORAGE   buildah/podman storage driver (default: theirs; vfs where overlay is unavailable)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-build}
BUILDER=${BUILDER:-$(for b in docker podman buildah; do command -v "$b" >/dev/null 2>&1 && { echo "$b"; break; }; done)}
[ -n "$BUILDER" ] || { echo "no image builder found: install docker, podman or buildah (BUILDER=...)" >&2; exit 2; }
BASE=${BASE:-python:3.11-slim}
TAG=${TAG:-$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)}
storage=()
[ -n "${STORAGE:-}" ] && [ "$BUILDER" != docker ] && storage=(--storage-driver "$STORAGE")
mounts=()
[ -n "${CA_BUNDLE:-}" ] && mounts+=(--volume "$(realpath "$CA_BUNDLE"):/etc/ssl/certs/ca-certificates.crt:ro")
args=(--build-arg "BASE=$BASE")
if [ -n "${WHEELS:-}" ]; then
  mounts+=(--volume "$(realpath "$WHEELS"):/wheels:ro")
  args+=(--build-arg PIP_FIND_LINKS=/wheels)
fi
build() {  # name dockerfile
  local started=$SECONDS
  case "$BUILDER" in
    buildah) buildah "${storage[@]}" bud --isolation chroot --layers=false "${args[@]}" "${mounts[@]}" \
               -f "$2" -t "$1:$TAG" . ;;
    podman) podman "${storage[@]}" build "${args[@]}" "${mounts[@]}" -f "$2" -t "$1:$TAG" . ;;
    docker)
      # docker build mounts no volumes: a wheel folder or CA bundle must be in the context instead.
      [ -z "${CA_BUNDLE:-}${WHEELS:-}" ] || { echo "CA_BUNDLE/WHEELS need podman or buildah" >&2; exit 2; }
      docker build "${args[@]}" -f "$2" -t "$1:$TAG" . ;;
  esac
  echo "built $1:$TAG with $BUILDER from $BASE in $((SECONDS - started)) s"
}
case "$what" in
  build)
    build gpu-watchdog-inference docker/inference.Dockerfile
    build gpu-watchdog-watchdog docker/watchdog.Dockerfile ;;
  push)
    [ -n "${REGISTRY:-}" ] || { echo "make push needs REGISTRY=host/path" >&2; exit 2; }
    for name in gpu-watchdog-inference gpu-watchdog-watchdog; do
      case "$BUILDER" in
        buildah|podman) "$BUILDER" "${storage[@]}" push "$name:$TAG" "docker://$REGISTRY/$name:$TAG" ;;
        docker) docker tag "$name:$TAG" "$REGISTRY/$name:$TAG" && docker push "$REGISTRY/$name:$TAG" ;;
      esac
    done ;;
  *) echo "usage: docker/build.sh build|push" >&2; exit 2 ;;
esac
