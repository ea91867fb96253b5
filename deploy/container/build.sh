#!/usr/bin/env bash
# Builds the container image deploy/kubernetes/ runs from what
# scripts/setup.sh built on this host: stages the binaries and the guest
# kernel + initramfs in a temporary context, then `docker build` (or podman).
#   deploy/container/build.sh [IMAGE]        # default forkd:0.1.0
set -euo pipefail
. "$(dirname "$0")/../../scripts/lib.sh"
image=${1:-forkd:0.1.0}
bindir="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release"
kdir="$FORKD_HOME/kernel"
for b in forkd poold forkd-fs forkd-gateway; do
  [ -x "$bindir/$b" ] || die "no $bindir/$b: run scripts/setup.sh first"
done
[ -f "$kdir/current/initramfs.img" ] || die "no guest initramfs in $kdir/current: run scripts/setup.sh first"
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
mkdir -p "$ctx/bin" "$ctx/kernel"
cp "$bindir"/{forkd,poold,forkd-fs,forkd-gateway} "$ctx/bin/"
release=$(readlink "$kdir/current")
cp -a "$kdir/$release" "$ctx/kernel/"
ln -s "$release" "$ctx/kernel/current"
tool=$(command -v docker || command -v podman) || die "no docker or podman"
"$tool" build -t "$image" -f "$REPO_ROOT/deploy/container/Containerfile" "$ctx"
say "built $image"
