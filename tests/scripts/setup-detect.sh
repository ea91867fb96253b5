#!/usr/bin/env bash
# Tests scripts/lib.sh's host detection the way a newcomer's host looks:
# PATH without cargo (sudo's secure_path), rustup in root's or the invoking
# user's home, Rust only from apt, no sudo. Everything is faked in a temp
# dir: a PATH of plain tools, fake `cargo`/`rustc`/`apt-get`/`apt-cache`/
# `sudo`/`id`, and `getent` answering for fake homes. Nothing is installed.
# Run by the forkd-e2e test `setup_scripts` (so by scripts/test.sh).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
lib="$here/../../scripts/lib.sh"
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
fails=0
ok() { printf 'ok   %s\n' "$1"; }
bad() { printf 'FAIL %s\n' "$1"; fails=$((fails + 1)); }
check() { if [ "$2" = "$3" ]; then ok "$1"; else bad "$1: got [$2], want [$3]"; fi; }
contains() { case "$2" in *"$3"*) ok "$1" ;; *) bad "$1: [$2] lacks [$3]" ;; esac; }

# A PATH with the plain tools lib.sh uses, and nothing else; fakes go in
# $T/fake, which comes first (never written through a symlink in $T/bin).
mkdir -p "$T/bin" "$T/fake"
for t in sort head tail awk cut dirname basename sed grep cat env mkdir chmod chown stat id mktemp rm install timeout cp; do
  ln -s "$(command -v "$t")" "$T/bin/$t"
done
BASEPATH="$T/fake:$T/bin"

# fake_rust DIR VERSION [RUSTUP_HOME]: a cargo and rustc; with RUSTUP_HOME,
# rustc acts as a rustup proxy and fails unless RUSTUP_HOME points there.
fake_rust() {
  mkdir -p "$1"
  printf '#!/bin/sh\necho "cargo %s"\n' "$2" > "$1/cargo"
  if [ -n "${3:-}" ]; then
    printf '#!/bin/sh\n[ "$RUSTUP_HOME" = "%s" ] || { echo "error: rustup could not choose a version of rustc to run" >&2; exit 1; }\necho "rustc %s (fake)"\n' "$3" "$2" > "$1/rustc"
  else
    printf '#!/bin/sh\necho "rustc %s (fake)"\n' "$2" > "$1/rustc"
  fi
  chmod +x "$1/cargo" "$1/rustc"
}

# scenario NAME BODY: runs BODY in a fresh shell with lib.sh sourced, the
# stripped PATH, HOME=/root-like fake, and getent answering from $T/passwd.
scenario() {
  env -i PATH="$BASEPATH" HOME="$T/root" T="$T" LIB="$lib" ${SUDO_USER_FAKE:+SUDO_USER=$SUDO_USER_FAKE} \
    "$BASH" -c '
      set -euo pipefail
      . "$LIB"
      getent() { [ "$1" = passwd ] && grep "^$2:" "$T/passwd"; }
      '"$2"
}

cat > "$T/passwd" <<P
root:x:0:0:root:$T/root:/bin/bash
alice:x:1000:1000::$T/home/alice:/bin/bash
P
mkdir -p "$T/root"

# 1. sudo dropped ~/.cargo/bin: alice's rustup install is found, with her RUSTUP_HOME.
fake_rust "$T/home/alice/.cargo/bin" 1.91.0 "$T/home/alice/.rustup"
mkdir -p "$T/home/alice/.rustup"
out=$(SUDO_USER_FAKE=alice scenario 1 'ensure_cargo >/dev/null; echo "$CARGO_DIR|$RUSTUP_HOME|$(rustc --version)|${PATH%%:*}"' 2>&1)
check "invoking user's rustup cargo found with PATH stripped" "$out" \
  "$T/home/alice/.cargo/bin|$T/home/alice/.rustup|rustc 1.91.0 (fake)|$T/home/alice/.cargo/bin"

# 2. root's own rustup comes first.
fake_rust "$T/root/.cargo/bin" 1.89.0
out=$(SUDO_USER_FAKE=alice scenario 2 'ensure_cargo >/dev/null; echo "$CARGO_DIR|${RUSTUP_HOME:-unset}"' 2>&1)
check "root's ~/.cargo/bin preferred" "$out" "$T/root/.cargo/bin|unset"

# 3. cargo on PATH comes before both.
fake_rust "$T/opt/bin" 1.88.0
out=$(SUDO_USER_FAKE=alice BASEPATH="$BASEPATH:$T/opt/bin" scenario 3 'ensure_cargo >/dev/null; echo "$CARGO_DIR"' 2>&1)
check "cargo on PATH preferred" "$out" "$T/opt/bin"

# 4. a too-old compiler is skipped for a newer one, and named when it is the only one.
fake_rust "$T/root/.cargo/bin" 1.63.0
out=$(SUDO_USER_FAKE=alice scenario 4 'ensure_cargo >/dev/null; echo "$CARGO_DIR"' 2>&1)
check "too-old root toolchain skipped for the user's" "$out" "$T/home/alice/.cargo/bin"
out=$(scenario 4b 'ensure_cargo' 2>&1); rc=$?
check "only a too-old toolchain: exit status" "$rc" 1
contains "only a too-old toolchain: says which and what to do" "$out" "1.63.0 in $T/root/.cargo/bin is too old"
rm -rf "$T/root/.cargo"

# 5. no Rust anywhere: Debian 12's rustc-web/cargo-web from apt.
cat > "$T/fake/apt-cache" <<'A'
#!/bin/sh
case "$2" in
  rustc-web) printf 'rustc-web:\n  Installed: (none)\n  Candidate: %s\n' "${FAKE_WEB:-(none)}" ;;
  rustc) printf 'rustc:\n  Installed: (none)\n  Candidate: 1.63.0+dfsg1-2\n' ;;
esac
A
cat > "$T/fake/apt-get" <<'A'
#!/bin/sh
echo "$*" >> "$T/apt-get.log"
mkdir -p "$T/usr/bin"
printf '#!/bin/sh\necho "cargo 1.96.0"\n' > "$T/usr/bin/cargo"
printf '#!/bin/sh\necho "rustc 1.96.0 (debian)"\n' > "$T/usr/bin/rustc"
chmod +x "$T/usr/bin/cargo" "$T/usr/bin/rustc"
A
chmod +x "$T/fake/apt-cache" "$T/fake/apt-get"
out=$(FAKE_WEB=1.96.0+dfsg1-1~deb12u2 BASEPATH="$BASEPATH:$T/usr/bin" scenario 5 \
  'FORKD_RUST=distro FAKE_WEB='"1.96.0+dfsg1-1~deb12u2"' export FAKE_WEB; ensure_cargo --install >/dev/null; echo "$CARGO_DIR"' 2>&1)
check "no Rust: distribution's packages installed and used" "$out" "$T/usr/bin"
contains "apt-get asked for rustc-web and cargo-web" "$(cat "$T/apt-get.log" 2>/dev/null)" "rustc-web cargo-web"
rm -rf "$T/usr" "$T/apt-get.log"
out=$(BASEPATH="$BASEPATH:$T/usr/bin" scenario 5b 'FORKD_RUST=distro; ensure_cargo --install' 2>&1); rc=$?
check "apt has only Rust 1.63: exit status" "$rc" 1
contains "apt has only Rust 1.63: points at rustup" "$out" "install Rust with rustup"
check "apt has only Rust 1.63: nothing installed" "$(cat "$T/apt-get.log" 2>/dev/null)" ""
out=$(scenario 5c 'ensure_cargo' 2>&1); rc=$?
check "without --install nothing is installed" "$rc:$(cat "$T/apt-get.log" 2>/dev/null)" "1:"

# 5d. no Rust, the default: rustup's, its binary from the pinned wheel pip
# fetched (python3 faked: pip download, zipfile, and a rustup-init that
# records how it was run and leaves a cargo and rustc).
cat > "$T/fake/python3" <<'P'
#!/bin/sh
echo "$*" >> "$T/python3.log"
case "$1 $2" in
  "-m pip")
    [ "$3" = --version ] && { echo "pip 23.0.1"; exit 0; }
    if [ -n "${FAKE_PIP_FAIL:-}" ]; then
      echo "WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(Connection refused)'"
      echo "ERROR: No matching distribution found for rustup==1.29.0.1"
      exit 1
    fi
    while [ $# -gt 0 ]; do
      [ "$1" = -d ] && d=$2
      [ "$1" = -r ] && cp "$2" "$T/requirements.seen"
      shift
    done
    mkdir -p "$d" && : > "$d/rustup-1.29.0.1-py3-none-manylinux_2_17_x86_64.whl" ;;
  "-m zipfile")
    mkdir -p "$5/rustup-1.29.0.1.data/scripts"
    cat > "$5/rustup-1.29.0.1.data/scripts/rustup" <<'R'
#!/bin/sh
echo "$(basename "$0") $* CARGO_HOME=$CARGO_HOME RUSTUP_HOME=$RUSTUP_HOME" > "$T/rustup-init.args"
mkdir -p "$CARGO_HOME/bin"
printf '#!/bin/sh\necho "cargo 1.95.0"\n' > "$CARGO_HOME/bin/cargo"
printf '#!/bin/sh\necho "rustc 1.95.0 (rustup)"\n' > "$CARGO_HOME/bin/rustc"
chmod +x "$CARGO_HOME/bin/cargo" "$CARGO_HOME/bin/rustc"
R
    ;;
esac
P
chmod +x "$T/fake/python3"
rm -f "$T/apt-get.log"
out=$(scenario 5d 'ensure_cargo --install >/dev/null; echo "$CARGO_DIR|$(rustc --version)"' 2>&1)
check "no Rust: rustup's installed for root and used" "$out" "$T/root/.cargo/bin|rustc 1.95.0 (rustup)"
check "rustup-init ran with the pinned toolchain and the tests' components" "$(cat "$T/rustup-init.args" 2>/dev/null)" \
  "rustup-init -y -q --no-modify-path --profile minimal --component rustfmt,clippy --default-toolchain 1.95.0 CARGO_HOME=$T/root/.cargo RUSTUP_HOME=$T/root/.rustup"
contains "pip was held to the pinned hashes" "$(cat "$T/python3.log" "$T/requirements.seen" 2>/dev/null)" "--require-hashes"
contains "the requirement names the pinned wheel and its hashes" "$(cat "$T/requirements.seen" 2>/dev/null)" "rustup==1.29.0.1 --hash=sha256:47c6d01a"
check "rustup's path installs no apt package" "$(cat "$T/apt-get.log" 2>/dev/null)" ""
rm -rf "$T/root/.cargo" "$T/rustup-init.args" "$T/requirements.seen" "$T/python3.log"

# 5g. through sudo from alice, whose CARGO_HOME/RUSTUP_HOME as_root kept:
# rustup goes into root's homes, never hers, and is what setup then uses.
out=$(SUDO_USER_FAKE=alice scenario 5g \
  'CARGO_HOME=$T/home/alice/.cargo-none RUSTUP_HOME=$T/home/alice/.rustup-none; export CARGO_HOME RUSTUP_HOME; ensure_cargo --install >/dev/null; echo "$CARGO_DIR|$RUSTUP_HOME"' 2>&1)
check "through sudo: rustup's installed into root's homes and used" "$out" "$T/root/.cargo/bin|$T/root/.rustup"
check "through sudo: nothing written into the user's CARGO_HOME" "$(ls -d "$T/home/alice/.cargo-none" 2>/dev/null)" ""
rm -rf "$T/root/.cargo" "$T/rustup-init.args" "$T/requirements.seen" "$T/python3.log"

# 5e. pip cannot reach its index: the reason is said, and Debian's Rust is
# the fallback.
out=$(BASEPATH="$BASEPATH:$T/usr/bin" scenario 5e \
  'FAKE_PIP_FAIL=1 FAKE_WEB='"1.96.0+dfsg1-1~deb12u2"'; export FAKE_PIP_FAIL FAKE_WEB; ensure_cargo --install; echo "CARGO_DIR=$CARGO_DIR"' 2>&1)
contains "pip failing: its reason is said" "$out" "Connection refused"
contains "pip failing: says it falls back" "$out" "falling back to the distribution's"
contains "pip failing: the distribution's Rust is used" "$out" "CARGO_DIR=$T/usr/bin"
contains "pip failing: apt-get asked for rustc-web and cargo-web" "$(cat "$T/apt-get.log" 2>/dev/null)" "rustc-web cargo-web"
rm -rf "$T/usr" "$T/apt-get.log" "$T/python3.log" "$T/fake/python3" "$T/root/.cargo"

# 5f. a FORKD_RUST that is neither choice is refused.
out=$(scenario 5f 'FORKD_RUST=nightly; ensure_cargo --install' 2>&1); rc=$?
check "FORKD_RUST=nightly: exit status" "$rc" 1
contains "FORKD_RUST=nightly: names the choices" "$out" "set it to rustup (the default) or distro"
rm -f "$T/fake/apt-get" "$T/fake/apt-cache"

# 6. as_root: root runs on; a user without sudo gets told what to do; a
# user with sudo re-runs through it keeping PATH.
out=$(scenario 6 'as_root /x/setup.sh a; echo continued' 2>&1)
check "as root: runs on without sudo" "$out" "continued"
printf '#!/bin/sh\necho 1000\n' > "$T/fake/id"; chmod +x "$T/fake/id"
out=$(scenario 6b 'as_root /x/setup.sh a; echo continued' 2>&1); rc=$?
check "not root, no sudo: exit status" "$rc" 1
contains "not root, no sudo: says to use a root shell" "$out" "there is no sudo"
printf '#!/bin/sh\necho "sudo $*"\n' > "$T/fake/sudo"; chmod +x "$T/fake/sudo"
out=$(scenario 6c 'FORKD_HOME=/srv/f as_root /x/setup.sh --no-images; echo continued' 2>&1)
contains "not root, sudo: re-runs through sudo keeping PATH" "$out" "sudo env PATH=$BASEPATH FORKD_HOME=/srv/f bash /x/setup.sh --no-images"
case "$out" in *continued*) bad "as_root returned after exec" ;; *) ok "as_root execs" ;; esac
rm -f "$T/fake/id" "$T/fake/sudo"

# 7. step timings and their summary.
out=$(scenario 7 'step one true; step two true; step_summary "Setup done"' 2>&1)
contains "step prints its time" "$out" "[one: 0s]"
contains "summary prints the total" "$out" "Setup done in 0s"

# 8. a build through sudo hands the checkout's target/ back to its owner.
mkdir -p "$T/repo/target/release"; touch "$T/repo/target/release/forkd"
chown nobody "$T/repo"
scenario 8a 'REPO_ROOT=$T/repo; return_target'
check "no sudo: target/ left alone" "$(stat -c %U "$T/repo/target/release/forkd")" root
SUDO_USER_FAKE=nobody scenario 8b 'REPO_ROOT=$T/repo; return_target'
check "sudo build: target/ back to the checkout's owner" "$(stat -c %U "$T/repo/target/release/forkd")" nobody
chown -R root "$T/repo/target"
SUDO_USER_FAKE=nobody scenario 8c 'REPO_ROOT=$T/repo; CARGO_TARGET_DIR=/elsewhere return_target'
check "CARGO_TARGET_DIR set: left alone" "$(stat -c %U "$T/repo/target/release/forkd")" root

if [ "$fails" -gt 0 ]; then echo "$fails check(s) failed"; exit 1; fi
echo "all setup detection checks passed"
