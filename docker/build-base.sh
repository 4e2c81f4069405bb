#!/usr/bin/env bash
# Build a base image for Sluice from Debian packages alone, for hosts that cannot pull from a
# container registry (air-gapped, or behind a proxy that only lets package mirrors through).
#
#   sudo docker/build-base.sh [TAG]          # default TAG: sluice-base:bookworm
#   docker compose build --build-arg BASE_IMAGE=sluice-base:bookworm   (or SLUICE_BASE_IMAGE=... in .env)
#
# It stands in for python:3.11-slim: Debian bookworm's Python 3.11 with venv and pip, CA
# certificates, and nothing else. Needs root, debootstrap and a Debian mirror over plain HTTP
# (DEBIAN_MIRROR, default http://deb.debian.org/debian). Takes about a minute.
set -euo pipefail

TAG=${1:-sluice-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
command -v debootstrap >/dev/null || { echo "build-base.sh: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "build-base.sh: debootstrap needs root" >&2; exit 1; }

ROOT=$(mktemp -d /tmp/sluice-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT

debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$ROOT" "$MIRROR"
# What an image needs and a bootstrap leaves behind: package lists and caches are dead weight.
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/*
# python:3.11-slim answers to `python`; so does this image.
ln -sf python3 "$ROOT/usr/bin/python"

tar -C "$ROOT" -c . | docker import \
  --change 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["python3"]' - "$TAG"
echo "built $TAG"
