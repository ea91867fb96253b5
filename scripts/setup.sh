#!/usr/bin/env bash
# forkd host setup. Idempotent and safe to re-run; prints what it does.
#
#   scripts/setup.sh                 # everything: packages, kernel, build, images
#   scripts/setup.sh --no-images     # skip step 5
#   scripts/setup.sh --no-install    # skip copying binaries to /usr/local/bin
#
# Runs as root: from a root shell as is, else it re-runs itself through sudo.
# Steps (each one's time, and the total, are printed at the end):
#   1. host packages: debootstrap, e2fsprogs, FUSE, build tools, and QEMU
#      >= 10 (from bookworm-backports on Debian 12, derived from your
#      existing apt sources; installed in the background during step 3);
#      Rust >= 1.88: cargo on PATH, in root's or the sudo-invoking
#      user's ~/.cargo/bin (rustup), else rustup's Rust installed for root
#      (rustup from PyPI's pinned `rustup` wheel), else the distribution's
#      packages (rustc-web/cargo-web on Debian 12; FORKD_RUST=distro
#      chooses them over rustup's); virtiofsd for volumes (Debian's
#      package on Debian 13+, else built with cargo install, pinned)
#   2. the pinned guest kernel (scripts/fetch-kernel.sh)
#   3. the workspace, release build; forkd, poold, forkd-fs installed to /usr/local/bin
#   4. the guest initramfs (scripts/build-guest.sh), and beside it
#   5. the guest images `minimal` and `python-numpy` into $FORKD_HOME/images
set -euo pipefail
. "$(dirname "$0")/lib.sh"

images=1
install=1
for a in "$@"; do
  case "$a" in
    --no-images) images=0 ;;
    --no-install) install=0 ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) die "unknown option $a (see --help)" ;;
  esac
done
as_root "$0" "$@"
export DEBIAN_FRONTEND=noninteractive

qemu_major() {
  qemu-system-x86_64 --version 2>/dev/null | sed -n '1s/.*version \([0-9]*\).*/\1/p'
}

# Major version a package would install: from the default candidate, or from
# suite $2 when given.
candidate_major() {
  local v
  if [ -n "${2:-}" ]; then
    v=$(apt-cache madison "$1" 2>/dev/null | awk -F'|' -v s=" $2/" 'index($3, s) { gsub(/ /, "", $2); print $2; exit }')
  else
    v=$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p')
  fi
  v=${v#*:}
  case "$v" in ''|'(none)') echo "" ;; *) echo "${v%%.*}" ;; esac
}

# Writes a deb822 source for <codename>-backports using the URI, components
# and key of the existing source that serves <codename>.
enable_backports() {
  local codename=$1 file=/etc/apt/sources.list.d/forkd-backports.sources line uri comps key
  if [ -f "$file" ]; then note "backports already enabled ($file)"; return; fi
  line=$(awk -v RS='' -v cn="$codename" '
    { types=""; uris=""; suites=""; comps=""; signed=""
      n = split($0, l, "\n")
      for (i = 1; i <= n; i++) { s = l[i]; if (s ~ /^#/) continue
        if (sub(/^Types:[ \t]*/, "", s)) types = s
        else if (sub(/^URIs:[ \t]*/, "", s)) uris = s
        else if (sub(/^Suites:[ \t]*/, "", s)) suites = s
        else if (sub(/^Components:[ \t]*/, "", s)) comps = s
        else if (sub(/^Signed-By:[ \t]*/, "", s)) signed = s }
      if (types !~ /(^| )deb( |$)/) next
      ns = split(suites, x, /[ \t]+/)
      for (j = 1; j <= ns; j++) if (x[j] == cn) { print uris "|" comps "|" signed; exit } }
  ' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  if [ -z "$line" ] && [ -f /etc/apt/sources.list ]; then
    # One-line format: deb [opts] URI SUITE COMPONENTS...
    line=$(awk -v cn="$codename" '$1 == "deb" {
        i = 2; opts = ""; if ($2 ~ /^\[/) { while ($i !~ /\]$/) { opts = opts " " $i; i++ } opts = opts " " $i; i++ }
        if ($(i+1) == cn) { c = ""; for (k = i+2; k <= NF; k++) c = c " " $k
          key = ""; if (match(opts, /signed-by=[^] ]*/)) key = substr(opts, RSTART+10, RLENGTH-10)
          print $i "|" substr(c, 2) "|" key; exit } }' /etc/apt/sources.list)
  fi
  [ -n "$line" ] || die "no apt source serves '$codename', so $codename-backports cannot be derived; add a Debian $codename source, or install QEMU >= 10 yourself"
  IFS='|' read -r uri comps key <<<"$line"
  say "Enabling $codename-backports (from your $codename source: $uri)"
  {
    echo "# Added by forkd scripts/setup.sh: QEMU >= 10 comes from $codename-backports."
    echo "Types: deb"
    echo "URIs: $uri"
    echo "Suites: $codename-backports"
    echo "Components: ${comps:-main}"
    [ -n "$key" ] && echo "Signed-By: $key"
  } > "$file"
  apt-get update -q
}

install_packages() {
  say "Installing host packages"
  local base=(debootstrap e2fsprogs cpio busybox-static fuse3 pkg-config clang libclang-dev
              lld build-essential file iproute2 nftables ca-certificates git
              libseccomp-dev libcap-ng-dev)
  apt-get update -q >/dev/null || note "apt-get update reported errors; continuing"
  apt-get install -y -q --no-install-recommends "${base[@]}" >/dev/null
  note "installed: ${base[*]}"
  plan_qemu
}

# QEMU >= 10. Nothing before the quickstart boots a guest (the build, the
# initramfs and the images do not), so plan_qemu only decides where QEMU
# comes from (enabling backports, or failing early when no source has it),
# start_qemu runs the apt install in the background beside the build, and
# wait_qemu waits for it at the end. The install starts after every other
# apt use of setup's (Rust, virtiofsd, the kernel's download), so nothing
# waits on apt's lock; an exit before wait_qemu still waits for it (see the
# EXIT trap below), never leaving dpkg half done.
QEMU_APT=()
QEMU_PID=
QEMU_LOG=
plan_qemu() {
  . /etc/os-release
  local codename=${VERSION_CODENAME:-}
  if [ "$(qemu_major)" != "" ] && [ "$(qemu_major)" -ge 10 ]; then
    note "QEMU $(qemu-system-x86_64 --version | sed -n '1s/.*version \([^ ]*\).*/\1/p') already installed"
    QEMU_APT=(qemu-utils)
    return
  fi
  local m; m=$(candidate_major qemu-system-x86)
  if [ -n "$m" ] && [ "$m" -ge 10 ]; then
    QEMU_APT=(qemu-system-x86 qemu-utils)
  elif [ "${ID:-}" = debian ] && [ -n "$codename" ]; then
    note "QEMU in $codename is ${m:-missing}; forkd needs >= 10 from $codename-backports"
    enable_backports "$codename"
    m=$(candidate_major qemu-system-x86 "$codename-backports")
    [ -n "$m" ] && [ "$m" -ge 10 ] || die "$codename-backports has no QEMU >= 10 (found ${m:-none})"
    QEMU_APT=(-t "$codename-backports" qemu-system-x86 qemu-utils)
  else
    die "QEMU >= 10 is not available from your apt sources (found ${m:-none}); forkd needs Debian 12 with backports, Debian 13+, or Ubuntu 25.10+"
  fi
}

start_qemu() {
  QEMU_LOG=$(mktemp /tmp/forkd-qemu-install.XXXXXX)
  note "installing ${QEMU_APT[*]} in the background, beside the build (log: $QEMU_LOG)"
  (
    t0=$SECONDS
    apt-get install -y -q --no-install-recommends "${QEMU_APT[@]}" >/dev/null
    echo "    QEMU $(qemu-system-x86_64 --version | sed -n '1s/.*version \([^ ]*\).*/\1/p') installed, in the background ($(( SECONDS - t0 ))s)"
  ) >"$QEMU_LOG" 2>&1 &
  QEMU_PID=$!
}

wait_qemu() {
  [ -n "$QEMU_PID" ] || return 0
  local pid=$QEMU_PID
  QEMU_PID=
  if ! wait "$pid"; then
    cat "$QEMU_LOG" >&2
    die "installing QEMU (apt-get install ${QEMU_APT[*]}) failed (above); forkd needs QEMU >= 10. Re-run scripts/setup.sh"
  fi
  cat "$QEMU_LOG"
  rm -f "$QEMU_LOG"
}

# On any exit (a failed build, Ctrl-C): a QEMU install still running is
# waited for, so dpkg finishes and the apt lock is free for a re-run.
on_exit() {
  if [ -n "$QEMU_PID" ]; then
    note "waiting for the background QEMU install to finish (log: $QEMU_LOG)"
    wait "$QEMU_PID" 2>/dev/null || true
  fi
}
trap on_exit EXIT

# virtiofsd serves host folders to guests (docs/volumes.md): Debian's
# package where the release has one (Debian 13+; bookworm has none), else the
# same program built with `cargo install`, pinned (1.11+ is needed: snapshots
# carry its state). Building it needs libseccomp-dev and libcap-ng-dev.
# The cargo install runs in the background beside forkd's own build (the
# build leaves a core idle for long stretches: its last crates compile one
# at a time), and build_workspace waits for it.
VIRTIOFSD_VERSION=1.14.0
VIRTIOFSD_PID=
VIRTIOFSD_LOG=
install_virtiofsd() {
  if [ -x /usr/libexec/virtiofsd ] || command -v virtiofsd >/dev/null; then
    note "virtiofsd already installed (volumes)"
    return
  fi
  if apt-get install -y -q --no-install-recommends virtiofsd >/dev/null 2>&1; then
    note "installed virtiofsd from apt (volumes)"
    return
  fi
  VIRTIOFSD_LOG=$(mktemp /tmp/forkd-virtiofsd-build.XXXXXX)
  note "no virtiofsd package in this release: building virtiofsd $VIRTIOFSD_VERSION with cargo install, beside forkd's build (log: $VIRTIOFSD_LOG)"
  cargo install --quiet --locked virtiofsd --version "$VIRTIOFSD_VERSION" --root /usr/local \
    >"$VIRTIOFSD_LOG" 2>&1 &
  VIRTIOFSD_PID=$!
}

wait_virtiofsd() {
  [ -n "$VIRTIOFSD_PID" ] || return 0
  if ! wait "$VIRTIOFSD_PID"; then
    cat "$VIRTIOFSD_LOG" >&2
    die "building virtiofsd with cargo install failed (above); volumes need it. Re-run scripts/setup.sh"
  fi
  rm -f "$VIRTIOFSD_LOG"
  note "installed /usr/local/bin/virtiofsd"
}

build_workspace() {
  say "Building forkd (release)"
  # cargo --quiet prints nothing until it is done; say what to expect so a
  # first build (RocksDB's C++ and ~400 crates) does not look hung.
  [ -d "${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/deps" ] ||
    note "first build: ~400 crates and RocksDB, about 11 minutes on a 2-core host with rustup's Rust, 16 with Debian's; quiet until done"
  # The four programs forkd runs (the tests find them here too); the bench
  # tools are `cargo run`. --workspace keeps the features of every shared
  # dependency those of the whole workspace, so the test build reuses them.
  # FORKD_BUILD_TIMINGS=1: cargo's per-crate report, in target/cargo-timings.
  local timings=()
  [ "${FORKD_BUILD_TIMINGS:-0}" = 1 ] && timings=(--timings)
  (cd "$REPO_ROOT" && cargo build --release --quiet --workspace "${timings[@]}" \
    --bin forkd --bin poold --bin forkd-fs --bin forkd-gateway)
  wait_virtiofsd
  return_target
  [ "$install" = 1 ] || return 0
  local bindir="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release"
  for b in forkd poold forkd-fs; do
    [ -x "$bindir/$b" ] && install -m 0755 "$bindir/$b" /usr/local/bin/$b
  done
  note "installed forkd, poold, forkd-fs to /usr/local/bin"
  if [ -d /etc/systemd/system ]; then
    install -m 0644 "$REPO_ROOT/poold/systemd/poold.service" /etc/systemd/system/poold.service
    note "installed /etc/systemd/system/poold.service (not enabled: systemctl enable --now poold)"
  fi
}

# The static guest binaries (a small cargo build: CPU) and the images
# (debootstrap: downloads and unpacking) need nothing of each other, so they
# are made side by side; the initramfs build's output is shown after.
build_guest() {
  [ "$images" = 1 ] || { "$REPO_ROOT/scripts/build-guest.sh"; return; }
  local log pid rc=0
  log=$(mktemp /tmp/forkd-initramfs.XXXXXX)
  "$REPO_ROOT/scripts/build-guest.sh" >"$log" 2>&1 &
  pid=$!
  build_images || rc=$?
  if [ "$rc" != 0 ]; then
    # The initramfs build (and its cargo) stops too; the images' error is above.
    pkill -TERM -P "$pid" 2>/dev/null || true
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    rm -f "$log"
    die "building the images failed (above). Re-run scripts/setup.sh"
  fi
  if ! wait "$pid"; then
    cat "$log" >&2
    die "building the initramfs failed (above). Re-run scripts/setup.sh"
  fi
  cat "$log"
  rm -f "$log"
}

build_images() {
  local forkd="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/forkd"
  for r in minimal python-numpy; do
    if [ -n "${FORKD_REBUILD_IMAGES:-}" ]; then
      "$forkd" image build --recipe "$r" || return
    else
      "$forkd" image build --recipe "$r" --if-changed || return
    fi
  done
}

say "forkd setup (data dir: $FORKD_HOME)"
step packages install_packages
step rust ensure_cargo --install
step virtiofsd install_virtiofsd
# Root's and closed to other users, as poold sets it at start (docs/security.md).
mkdir -p "$FORKD_HOME" && chmod 700 "$FORKD_HOME"
step kernel "$REPO_ROOT/scripts/fetch-kernel.sh"
start_qemu
step build build_workspace
export FORKD_HOME
if [ "$images" = 1 ]; then
  step "initramfs + images" build_guest
else
  step initramfs build_guest
fi
step "qemu (rest of its background install)" wait_qemu
step_summary "Setup done"
[ "$images" = 1 ] && say "Try: forkd run --image python-numpy -- python3 -c 'import numpy; print(numpy.zeros(5).tolist())'"
exit 0
