#!/usr/bin/env bash
# Times README's first command the way a newcomer meets it: in a fresh
# Debian 12 root (debootstrap, minbase) on this host, with empty caches (no
# cargo registry, no target dir, no images, no apt packages beyond the base),
# the checkout cloned into it. Prints setup's step times, the quickstart's
# two commands' times and the total, and keeps cargo's per-crate report of
# setup's build (--timings) as /var/tmp/forkd-setup-timings.html.
# docs/BENCHMARKS.md records its output.
#
#   scripts/bench-setup-chroot.sh [DIR]     # DIR: where the root goes
#                                           # (default /var/tmp/forkd-setup-bench)
#
# Root only. The root shares this host's kernel, /dev (KVM or not, FUSE,
# tun), /proc, /sys and cgroups, as a container would; its apt sources are
# this host's Debian sources (derived, as setup.sh derives backports), and
# it downloads packages and crates as a fresh host does. The root is
# deleted at the end unless FORKD_KEEP_ROOT=1.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
need_root "$0"

root=${1:-/var/tmp/forkd-setup-bench}
[ -e "$root" ] && die "$root exists; remove it or name another directory"

# The first deb URI serving bookworm in this host's sources.
mirror=$(awk '/^URIs:/ {u=$2} /^Suites:/ && / bookworm( |$)/ {print u; exit}' \
  /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$mirror" ] || mirror=$(awk '$1=="deb" && $3=="bookworm" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
[ -n "$mirror" ] || die "no apt source serves bookworm on this host; add one"

mounted=()
cleanup() {
  local m
  # Anything still running in the root (a forkd-fs holder) goes first.
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && kill -9 "${p#/proc/}" 2>/dev/null || true
  done
  sleep 1
  for m in $(awk -v r="$root" 'index($2, r) == 1 {print $2}' /proc/self/mounts | sort -r); do
    umount -l "$m" 2>/dev/null || true
  done
  [ "${FORKD_KEEP_ROOT:-0}" = 1 ] || rm -rf --one-file-system "$root"
}
trap cleanup EXIT

say "Debian 12 root at $root (debootstrap from $mirror)"
t0=$SECONDS
debootstrap --variant=minbase --include=ca-certificates,git,procps,kmod,iproute2 \
  bookworm "$root" "$mirror" >/dev/null
cp /etc/resolv.conf "$root/etc/resolv.conf"
# The CAs this host added (a TLS-inspecting proxy's, say): a fresh host on
# the same network would have them too, or reach no registry.
if compgen -G '/usr/local/share/ca-certificates/*' >/dev/null; then
  cp -r /usr/local/share/ca-certificates/. "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
rm -f "$root/etc/apt/sources.list"
for f in /etc/apt/sources.list.d/*.sources; do
  # Only Debian's own sources, not what setup.sh added to this host.
  grep -q 'forkd scripts/setup.sh' "$f" || cp "$f" "$root/etc/apt/sources.list.d/"
done
note "[root: $(( SECONDS - t0 ))s, not counted]"

# The VM jail pivots into its own root, which needs / to be a mount point.
mount --bind "$root" "$root"
for d in dev dev/pts proc sys sys/fs/cgroup; do
  mkdir -p "$root/$d"
  mount --rbind "/$d" "$root/$d"
  mount --make-rslave "$root/$d"
done
mount -t tmpfs tmpfs "$root/run"
mount -t tmpfs tmpfs "$root/tmp"
git clone -q "$REPO_ROOT" "$root/root/forkd"

# README's first command, as written there, timed per part.
readme=$(sed -n '/^## Get started/,/^## /p' "$REPO_ROOT/README.md" | sed -n '/^```sh$/,/^```$/p' | sed -n 2p)
case "$readme" in
  "scripts/setup.sh && "*) ;;
  *) die "README's first command changed shape ($readme); update this script" ;;
esac
say "In the root: $readme"
chroot "$root" /usr/bin/env -i HOME=/root TERM=dumb FORKD_BUILD_TIMINGS=1 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  bash -c '
    set -euo pipefail
    cd /root/forkd
    t=$SECONDS; scripts/setup.sh; setup=$(( SECONDS - t ))
    rest=${1#scripts/setup.sh && }
    snap=${rest%% && forkd fork*}; fork=${rest#"$snap && "}
    t=$SECONDS; eval "$snap"; snapshot=$(( SECONDS - t ))
    t=$SECONDS; eval "$fork"; forks=$(( SECONDS - t ))
    printf "\n==> README first command in %ss: setup %ss, snapshot create %ss, fork %ss\n" \
      $(( setup + snapshot + forks )) "$setup" "$snapshot" "$forks"
  ' _ "$readme"
report=$(ls -t "$root"/root/forkd/target/cargo-timings/cargo-timing-*.html 2>/dev/null | head -1 || true)
if [ -n "$report" ]; then
  cp "$report" /var/tmp/forkd-setup-timings.html
  note "setup's build, crate by crate: /var/tmp/forkd-setup-timings.html"
fi
