#!/usr/bin/env bash
# Prepare `docker compose build` for a host that cannot reach everything the build would fetch:
# a container registry (for python:3.11-slim), PyTorch's package index (for torch), or the
# package index without an intercepting proxy's certificate. Everything comes from what this
# host already has, and each step says what it found:
#
#   1. the host's extra CA certificates  -> docker/ca-certificates/  (the image trusts them)
#   2. a torch wheel, through this host's pip configuration -> docker/wheels/
#   3. a base image: python:3.11-slim if it is here or can be pulled, else one built from Debian
#      packages (docker/build-base.sh: needs root and debootstrap), named in .env
#
#   docker/prepare-offline.sh [--env-file FILE]      (default: .env beside docker-compose.yml)
#   docker compose build --force-rm && docker compose up -d
#
# TORCH_VERSION (default 2.13.0) picks the wheel. Run it again at will: it only adds.
set -euo pipefail

cd "$(dirname "$0")/.."
ENV_FILE=.env
if [ "${1:-}" = "--env-file" ]; then ENV_FILE=${2:?--env-file needs a path}; fi
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE=python:3.11-slim
LOCAL_BASE=sluice-base:bookworm
say() { printf '%s\n' "$*"; }

say "[1/3] CA certificates this host trusts beyond the system's"
found=0
for dir in /usr/local/share/ca-certificates /etc/pki/ca-trust/source/anchors; do
  [ -d "$dir" ] || continue
  while IFS= read -r cert; do
    cp "$cert" "docker/ca-certificates/$(basename "${cert%.*}").crt"
    say "      $cert"
    found=$((found + 1))
  done < <(find "$dir" -type f \( -name '*.crt' -o -name '*.pem' \))
done
# A bundle pip is told to use (PIP_CERT, REQUESTS_CA_BUNDLE) may hold a proxy's CA too.
bundle=${PIP_CERT:-${REQUESTS_CA_BUNDLE:-}}
if [ -n "$bundle" ] && [ -f "$bundle" ] && [ "$found" = 0 ]; then
  cp "$bundle" docker/ca-certificates/host-bundle.crt
  say "      $bundle (the bundle pip uses here)"
  found=1
fi
[ "$found" = 0 ] && say "      none (fine unless an intercepting proxy stands between this host and the internet)"

say "[2/3] torch $TORCH_VERSION as a wheel (for a build that cannot reach PyTorch's index)"
if ls docker/wheels/torch-"$TORCH_VERSION"*.whl >/dev/null 2>&1; then
  say "      already there: $(ls docker/wheels/torch-"$TORCH_VERSION"*.whl)"
else
  # The image runs Python 3.11 on Linux x86_64: a wheel for anything else would not install.
  if python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
       "torch==$TORCH_VERSION" -d docker/wheels; then
    wheel=$(ls docker/wheels/torch-"$TORCH_VERSION"*.whl)
    say "      $wheel"
    case "$wheel" in
      *+cpu*) ;;
      *) say "      (not a CPU build: the image will be several GB; PyTorch's CPU wheels are at" \
             "https://download.pytorch.org/whl/cpu)" ;;
    esac
  else
    say "      pip could not get it: put a torch-$TORCH_VERSION wheel for Python 3.11 in docker/wheels/" >&2
    exit 1
  fi
fi

say "[3/3] a base image"
if docker image inspect "$BASE" >/dev/null 2>&1 || timeout 120 docker pull "$BASE" >/dev/null 2>&1; then
  say "      $BASE (the default: nothing to set)"
elif docker image inspect "$LOCAL_BASE" >/dev/null 2>&1 || docker/build-base.sh "$LOCAL_BASE"; then
  touch "$ENV_FILE"
  if grep -q '^SLUICE_BASE_IMAGE=' "$ENV_FILE"; then
    sed -i "s|^SLUICE_BASE_IMAGE=.*|SLUICE_BASE_IMAGE=$LOCAL_BASE|" "$ENV_FILE"
  else
    echo "SLUICE_BASE_IMAGE=$LOCAL_BASE" >> "$ENV_FILE"
  fi
  say "      $LOCAL_BASE, built from Debian packages ($BASE cannot be pulled); SLUICE_BASE_IMAGE set in $ENV_FILE"
else
  say "      $BASE cannot be pulled and no base could be built (docker/build-base.sh needs root and debootstrap)" >&2
  exit 1
fi

say "Ready: docker compose build --force-rm && docker compose up -d"
