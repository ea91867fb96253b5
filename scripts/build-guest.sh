#!/usr/bin/env bash
# Builds the static guest binaries (forkd-init, forkd-agent) and packs them
# with the kernel modules into $FORKD_HOME/kernel/current/initramfs.img.
# Rebuilds only what changed.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

kdir="$FORKD_HOME/kernel/current"
[ -f "$kdir/vmlinuz" ] || die "no kernel in $kdir; run scripts/fetch-kernel.sh first"
ensure_cargo
say "Building static guest binaries (forkd-init, forkd-agent)"
# `cargo rustc` passes crt-static to the binary's own compile and link only:
# the libraries are the ones the workspace build made (rootfs-init/Cargo.toml
# keeps their features the same), so this links two binaries instead of
# building their dependencies a second time for a --target. The flag is part
# of the binary's hash, so it does not replace a dynamic build's output
# in deps/; the uplifted copy in release/ is taken right away. From the
# checkout, so cargo reads its .cargo/config.toml (other flags: other hashes).
# FORKD_GUEST_EXPECT_REUSE=1 (scripts/test.sh, right after setup's build):
# fail if anything but forkd-rootfs-init was compiled, i.e. the feature
# unification above has drifted.
cd "$REPO_ROOT"
bindir="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release"
stage=$(mktemp -d)
log=$(mktemp)
trap 'rm -rf "$stage" "$log"' EXIT
mkdir -p "$stage"/{dev,proc,sys,newroot,etc/forkd,lib/modules}
for b in forkd-init forkd-agent; do
  args=(--release --quiet -p forkd-rootfs-init --bin "$b" -- -C target-feature=+crt-static)
  if ! cargo rustc --message-format=json "${args[@]}" >"$log"; then
    cargo rustc "${args[@]}" || true  # the errors, readable
    die "building the guest binary $b failed (above)"
  fi
  built=$(grep '"reason":"compiler-artifact"' "$log" | grep '"fresh":false' |
    grep -o '"package_id":"[^"]*"' | grep -v 'forkd-rootfs-init' || true)
  if [ -n "$built" ] && [ "${FORKD_GUEST_EXPECT_REUSE:-0}" = 1 ]; then
    die "building $b compiled libraries the workspace build should have made (their features differ: add them to rootfs-init/Cargo.toml's unification list): $(echo "$built" | tr '\n' ' ')"
  fi
  file "$bindir/$b" | grep -q 'static' || die "$bindir/$b is not statically linked"
  strip -o "$stage/$b" "$bindir/$b"
done
mv "$stage/forkd-init" "$stage/init"
cp "$kdir"/modules/*.ko "$stage/lib/modules/"
cp "$kdir/modules.order" "$stage/etc/forkd/modules.order"
# Fixed timestamps and order: the same inputs give the same bytes.
find "$stage" -exec touch -h -d @0 {} +
out="$kdir/initramfs.img"
(cd "$stage" && find . -mindepth 1 | LC_ALL=C sort | cpio --quiet -o -H newc --reproducible) > "$out.tmp"
mv "$out.tmp" "$out"
note "initramfs: $out ($(du -h "$out" | cut -f1))"
return_target
