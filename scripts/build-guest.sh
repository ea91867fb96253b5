#!/usr/bin/env bash
# Builds the static guest binaries (forkd-init, forkd-agent) and packs them
# with the kernel modules into $FORKD_HOME/kernel/current/initramfs.img.
# Rebuilds only what changed.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

kdir="$FORKD_HOME/kernel/current"
[ -f "$kdir/vmlinuz" ] || die "no kernel in $kdir; run scripts/fetch-kernel.sh first"
triple=x86_64-unknown-linux-gnu
ensure_cargo
say "Building static guest binaries (forkd-init, forkd-agent)"
# crt-static only for the target artifacts: --target keeps it away from build
# scripts and proc-macros, which must stay dynamic.
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --quiet -p forkd-rootfs-init --target "$triple" \
  --manifest-path "$REPO_ROOT/Cargo.toml"
bindir="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/$triple/release"
for b in forkd-init forkd-agent; do
  file "$bindir/$b" | grep -q 'static' || die "$bindir/$b is not statically linked"
done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage"/{dev,proc,sys,newroot,etc/forkd,lib/modules}
strip -o "$stage/init" "$bindir/forkd-init"
strip -o "$stage/forkd-agent" "$bindir/forkd-agent"
cp "$kdir"/modules/*.ko "$stage/lib/modules/"
cp "$kdir/modules.order" "$stage/etc/forkd/modules.order"
# Fixed timestamps and order: the same inputs give the same bytes.
find "$stage" -exec touch -h -d @0 {} +
out="$kdir/initramfs.img"
(cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc --reproducible) > "$out.tmp"
mv "$out.tmp" "$out"
note "initramfs: $out ($(du -h "$out" | cut -f1))"
