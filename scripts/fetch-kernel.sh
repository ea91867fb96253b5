#!/usr/bin/env bash
# Downloads the pinned Debian cloud kernel package (scripts/kernel.env),
# verifies its sha256, and extracts vmlinuz plus the guest modules
# (scripts/guest-modules.txt) into $FORKD_HOME/kernel/<release>/.
# Idempotent: does nothing when the extracted kernel is already there.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
. "$REPO_ROOT/scripts/kernel.env"

dest="$FORKD_HOME/kernel/$KERNEL_RELEASE"
# The package and the module list: a new module in guest-modules.txt
# re-extracts the kernel (then scripts/build-guest.sh repacks the initramfs).
want="$KERNEL_SHA256 $(sha256sum "$REPO_ROOT/scripts/guest-modules.txt" | cut -d' ' -f1)"
if [ -f "$dest/.complete" ] && [ "$(cat "$dest/.complete")" = "$want" ]; then
  note "kernel $KERNEL_RELEASE already in $dest"
  exit 0
fi
say "Fetching kernel $KERNEL_PACKAGE=$KERNEL_PACKAGE_VERSION"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# apt-get download fetches as the _apt user, which must be able to write
# here; otherwise apt falls back to root with a "Download is performed
# unsandboxed" warning. The package's sha256 is checked below either way.
chmod 755 "$work"
if id _apt >/dev/null 2>&1; then chown _apt "$work"; fi
deb="${FORKD_KERNEL_DEB:-}"
if [ -z "$deb" ]; then
  (cd "$work" && apt-get download -q "$KERNEL_PACKAGE=$KERNEL_PACKAGE_VERSION") \
    || die "apt-get download $KERNEL_PACKAGE=$KERNEL_PACKAGE_VERSION failed; is the Debian bookworm archive in your apt sources (apt-get update)?"
  deb=$(ls "$work"/*.deb)
fi
got=$(sha256sum "$deb" | cut -d' ' -f1)
[ "$got" = "$KERNEL_SHA256" ] || die "kernel package checksum mismatch: got $got, want $KERNEL_SHA256 (scripts/kernel.env)"
note "sha256 ok: $got"
dpkg-deb -x "$deb" "$work/x"
rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/modules"
cp "$work/x/boot/vmlinuz-$KERNEL_RELEASE" "$dest.tmp/vmlinuz"
cp "$work/x/boot/config-$KERNEL_RELEASE" "$dest.tmp/config"
moddir="$work/x/lib/modules/$KERNEL_RELEASE/kernel"
: > "$dest.tmp/modules.order"
grep -v '^\s*\(#\|$\)' "$REPO_ROOT/scripts/guest-modules.txt" | while read -r m; do
  [ -f "$moddir/$m" ] || die "module $m is not in $KERNEL_PACKAGE"
  cp "$moddir/$m" "$dest.tmp/modules/"
  basename "$m" >> "$dest.tmp/modules.order"
done
echo "$want" > "$dest.tmp/.complete"
rm -rf "$dest"
mv "$dest.tmp" "$dest"
ln -sfn "$KERNEL_RELEASE" "$FORKD_HOME/kernel/current"
note "kernel in $dest ($(wc -l < "$dest/modules.order") modules)"
