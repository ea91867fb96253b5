#!/usr/bin/env bash
# The test command: formatting, lints, unit tests, and end-to-end tests that
# boot real guests under TCG.
#
#   sudo scripts/test.sh                 # everything
#   sudo scripts/test.sh -- NAME         # extra arguments go to `cargo test`
#
# Tests use their own data dir ($FORKD_TEST_HOME, default /var/lib/forkd-test),
# never your $FORKD_HOME. Guest images there are rebuilt only when their recipe
# changed; the guest initramfs is rebuilt from the current sources every run.
set -euo pipefail
. "$(dirname "$0")/lib.sh"
need_root "scripts/test.sh"

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

"$REPO_ROOT/scripts/setup.sh" --no-images --no-install
cd "$REPO_ROOT"
say "cargo fmt --check"
cargo fmt --all -- --check
say "cargo clippy (release, all targets, -D warnings)"
cargo clippy --release --quiet --workspace --all-targets -- -D warnings
forkd="${CARGO_TARGET_DIR:-$REPO_ROOT/target}/release/forkd"
for r in minimal python-numpy; do
  "$forkd" image build --recipe "$r" --if-changed
done
say "cargo test (release)"
cargo test --release --workspace "${cargo_args[@]}"
say "All tests passed in $(( $(date +%s) - started ))s"
