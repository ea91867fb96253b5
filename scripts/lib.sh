# Shared helpers for forkd's scripts. Source it; do not run it.

# Data dir: everything forkd keeps lands here (docs/data-dir.md).
FORKD_HOME=${FORKD_HOME:-/var/lib/forkd}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }


# Re-runs the calling script as root: as is when already root, through sudo
# when there is one (keeping PATH, which sudo's secure_path would drop, and
# the forkd/cargo variables), else a clear error. Call: as_root "$0" "$@".
as_root() {
  [ "$(id -u)" = 0 ] && return 0
  local script=$1; shift
  command -v sudo >/dev/null 2>&1 ||
    die "$(basename "$script") must run as root, and there is no sudo: run it from a root shell (su -)"
  local keep=("PATH=$PATH") v
  # The proxy and index settings too: setup fetches crates, rustup and its
  # toolchain, and guest packages with them.
  for v in FORKD_HOME FORKD_TEST_HOME FORKD_ACCEL FORKD_BUILD_TIMINGS FORKD_RUST CARGO_TARGET_DIR CARGO_HOME RUSTUP_HOME \
           RUSTUP_DIST_SERVER RUSTUP_UPDATE_ROOT PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_CERT \
           http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
    [ -n "${!v:-}" ] && keep+=("$v=${!v}")
  done
  note "not root: re-running through sudo"
  exec sudo env "${keep[@]}" bash "$script" "$@"
}

need_root() {
  [ "$(id -u)" = 0 ] || die "$1 must run as root (try: sudo $0)"
}

# ---- Rust toolchain -------------------------------------------------------
# The workspace's rust-version (Cargo.toml); older compilers fail mid-build.
FORKD_MIN_RUST=1.88

# user_home USER: USER's home from the passwd database.
user_home() { getent passwd "$1" 2>/dev/null | cut -d: -f6; }

# return_target: after a build as root through sudo, hands the checkout's
# target/ back to the invoking user when the checkout is theirs, so their
# own cargo runs later are not refused by root-owned files. A target dir
# set with CARGO_TARGET_DIR is left as it is.
return_target() {
  [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ] && [ -z "${CARGO_TARGET_DIR:-}" ] || return 0
  [ -d "$REPO_ROOT/target" ] && [ "$(stat -c %U "$REPO_ROOT")" = "$SUDO_USER" ] || return 0
  chown -R "$SUDO_USER:" "$REPO_ROOT/target"
}

# version_ge A B: true when dotted version A >= B.
version_ge() {
  [ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" = "$2" ]
}

# cargo_candidates: directories that may hold cargo, best first: $PATH,
# $CARGO_HOME/bin, root's ~/.cargo/bin, then the invoking user's (sudo drops ~/.cargo/bin
# from PATH, and rustup installs per user).
cargo_candidates() {
  local p h
  p=$(command -v cargo 2>/dev/null) && dirname "$p"
  [ -n "${CARGO_HOME:-}" ] && echo "$CARGO_HOME/bin"
  h=$(user_home root) && [ -n "$h" ] && echo "$h/.cargo/bin"
  if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
    h=$(user_home "$SUDO_USER") && [ -n "$h" ] && echo "$h/.cargo/bin"
  fi
  return 0
}

# rust_version DIR: the version of DIR/rustc ("1.85.0"), empty when none runs.
rust_version() {
  "$1/rustc" --version 2>/dev/null | awk '{print $2}'
}

# find_cargo: sets CARGO_DIR to the first candidate directory whose cargo
# and rustc run and whose rustc is new enough, or fails. Exports RUSTUP_HOME
# for a rustup install in another user's home, so its proxies find their
# toolchains when run as root. Sets RUST_TOO_OLD to "DIR VERSION" of a
# compiler it skipped as too old. (Not in a subshell: it sets variables.)
find_cargo() {
  local d v home rh
  CARGO_DIR= RUST_TOO_OLD=
  for d in $(cargo_candidates); do
    [ -x "$d/cargo" ] || continue
    home=${d%/.cargo/bin} rh=
    if [ "$home" != "$d" ] && [ -z "${RUSTUP_HOME:-}" ] && [ -d "$home/.rustup" ] &&
       [ "$home" != "${HOME:-}" ]; then
      rh="$home/.rustup"
    fi
    v=$(RUSTUP_HOME=${rh:-${RUSTUP_HOME:-}} rust_version "$d")
    [ -n "$v" ] || continue
    if version_ge "$v" "$FORKD_MIN_RUST"; then
      CARGO_DIR=$d
      [ -n "$rh" ] && export RUSTUP_HOME=$rh
      return 0
    fi
    RUST_TOO_OLD="$d $v"
  done
  return 1
}

# apt_candidate PKG: the version apt would install ("1.85.0"), empty if none.
apt_candidate() {
  local v
  v=$(apt-cache policy "$1" 2>/dev/null | sed -n 's/^ *Candidate: //p')
  v=${v#*:}
  case "$v" in ''|'(none)') echo "" ;; *) echo "${v%%[+~-]*}" ;; esac
}

# distro_rust_packages: the apt packages that give a Rust >= FORKD_MIN_RUST:
# rustc-web/cargo-web on Debian 12 (its rustc/cargo are 1.63), else
# rustc/cargo when new enough. Prints nothing when apt has none.
distro_rust_packages() {
  local v
  v=$(apt_candidate rustc-web)
  if [ -n "$v" ] && version_ge "$v" "$FORKD_MIN_RUST"; then echo "rustc-web cargo-web"; return; fi
  v=$(apt_candidate rustc)
  if [ -n "$v" ] && version_ge "$v" "$FORKD_MIN_RUST"; then echo "rustc cargo"; return; fi
  return 0
}

# rustup's Rust for a host with none: the toolchain CI builds with, the
# profile setup and the tests need (rustc, cargo, rust-std; rustfmt and
# clippy for scripts/test.sh). rustup's compiler is PGO-built: it builds
# forkd in ~0.67x the time of Debian 12's rustc-web (docs/BENCHMARKS.md,
# "rustup's Rust on a host without Rust"), which stays the fallback.
FORKD_RUST_TOOLCHAIN=1.95.0
# rustup itself comes from PyPI's `rustup` wheel (the rustup binary,
# packaged by the maintainer of maturin), pinned by version and hash, so pip
# fetches it through this host's own index and proxy settings and nothing
# here names a download host. rustup then reads RUSTUP_DIST_SERVER and the
# proxy variables like any rustup (as_root keeps them through sudo).
RUSTUP_WHEEL="rustup==1.29.0.1"
RUSTUP_WHEEL_HASHES=(
  sha256:47c6d01a6b54b87308fe29ae91633757fb1c5862374e6dd8978955b411bff7e4 # x86_64
  sha256:771b3a48cc598dfa559c243c5be4358c79c785401b62d6508e23456969fb7a8c # aarch64
)

# first_problem LOG: the first warning or error line of LOG (pip says why
# a download failed in its retry warnings, not its last line), else its last.
first_problem() {
  grep -m 1 -E 'WARNING|ERROR|error' "$1" 2>/dev/null || grep . "$1" 2>/dev/null | tail -n 1
}

# install_rustup: installs FORKD_RUST_TOOLCHAIN with rustup into CARGO_HOME
# and RUSTUP_HOME (root's ~/.cargo and ~/.rustup when unset or when run
# through sudo), as that toolchain's default, and exports the two. Fails, after saying why,
# when pip, the package index or rustup's download server cannot be
# reached; it never waits long on a dead network (pip: one retry of 20 s;
# rustup: one retry, 60 s per download, 15 minutes at most).
install_rustup() {
  local tmp home cargo_home rustup_home rc=0
  home=$(user_home root)
  if [ -n "${SUDO_USER:-}" ] && [ "$SUDO_USER" != root ]; then
    # Through sudo: root's own, never the invoking user's homes (as_root
    # keeps their CARGO_HOME/RUSTUP_HOME; root must not write there).
    cargo_home=${home:+$home/.cargo} rustup_home=${home:+$home/.rustup}
  else
    cargo_home=${CARGO_HOME:-${home:+$home/.cargo}} rustup_home=${RUSTUP_HOME:-${home:+$home/.rustup}}
  fi
  [ -n "$cargo_home" ] && [ -n "$rustup_home" ] || { note "root has no home directory for rustup (set CARGO_HOME and RUSTUP_HOME)"; return 1; }
  if ! python3 -m pip --version >/dev/null 2>&1; then
    apt-get install -y -q --no-install-recommends python3-pip >/dev/null ||
      { note "could not install python3-pip to fetch rustup"; return 1; }
  fi
  tmp=$(mktemp -d /tmp/forkd-rustup.XXXXXX) || { note "could not make a temporary directory for rustup"; return 1; }
  {
    printf '%s' "$RUSTUP_WHEEL"
    printf ' --hash=%s' "${RUSTUP_WHEEL_HASHES[@]}"
    echo
  } >"$tmp/requirements.txt"
  note "fetching $RUSTUP_WHEEL through pip"
  if ! python3 -m pip download -q --no-deps --only-binary=:all: --require-hashes \
         --timeout 20 --retries 1 -r "$tmp/requirements.txt" -d "$tmp/wheel" >"$tmp/log" 2>&1; then
    note "pip could not fetch $RUSTUP_WHEEL: $(first_problem "$tmp/log")"
    rc=1
  elif ! python3 -m zipfile -e "$tmp"/wheel/rustup-*.whl "$tmp/x" >"$tmp/log" 2>&1 ||
       ! install -m 755 "$tmp"/x/rustup-*.data/scripts/rustup "$tmp/rustup-init" >>"$tmp/log" 2>&1; then
    note "no rustup binary in the $RUSTUP_WHEEL wheel: $(first_problem "$tmp/log")"
    rc=1
  else
    note "installing Rust $FORKD_RUST_TOOLCHAIN with rustup into $cargo_home (its default toolchain)"
    # Named rustup-init, the binary installs itself, the proxies and the
    # toolchain, as rustup's own installer does.
    if ! CARGO_HOME="$cargo_home" RUSTUP_HOME="$rustup_home" \
         RUSTUP_MAX_RETRIES=${RUSTUP_MAX_RETRIES:-1} RUSTUP_DOWNLOAD_TIMEOUT=${RUSTUP_DOWNLOAD_TIMEOUT:-60} \
         timeout 900 "$tmp/rustup-init" -y -q --no-modify-path --profile minimal \
         --component rustfmt,clippy --default-toolchain "$FORKD_RUST_TOOLCHAIN" >"$tmp/log" 2>&1; then
      note "rustup could not install Rust $FORKD_RUST_TOOLCHAIN: $(first_problem "$tmp/log")"
      rc=1
    fi
  fi
  rm -rf "$tmp"
  # The rest of setup (find_cargo, the build) uses what was installed.
  [ "$rc" = 0 ] && export CARGO_HOME="$cargo_home" RUSTUP_HOME="$rustup_home"
  return "$rc"
}

# ensure_cargo [--install]: puts a cargo with Rust >= FORKD_MIN_RUST first in
# PATH (see find_cargo), or dies saying what to do. With --install, a host
# with none gets rustup's Rust (install_rustup), else the distribution's
# packages (distro_rust_packages); FORKD_RUST=distro skips rustup.
ensure_cargo() {
  local pkgs old
  if ! find_cargo; then
    old=$RUST_TOO_OLD
    [ "${1:-}" = --install ] || die "no Rust >= $FORKD_MIN_RUST found${old:+ (${old#* } in ${old%% *} is too old)}: run scripts/setup.sh, or install Rust with rustup (https://rustup.rs)"
    case "${FORKD_RUST:-rustup}" in
      rustup|distro) ;;
      *) die "FORKD_RUST is '$FORKD_RUST': set it to rustup (the default) or distro (the distribution's packages only)" ;;
    esac
    if [ "${FORKD_RUST:-rustup}" = rustup ]; then
      note "no Rust >= $FORKD_MIN_RUST${old:+ (found ${old#* } in ${old%% *})}: installing rustup's Rust $FORKD_RUST_TOOLCHAIN"
      if install_rustup && find_cargo; then
        export PATH="$CARGO_DIR:$PATH"
        note "Rust $(rust_version "$CARGO_DIR") ($CARGO_DIR/cargo, rustup)"
        return 0
      fi
      note "rustup's Rust could not be installed (above): falling back to the distribution's, which builds forkd ~1.5x slower. For rustup's later: fix the package index or proxy, remove the distribution's rustc and cargo, and re-run"
    fi
    pkgs=$(distro_rust_packages)
    [ -n "$pkgs" ] || die "no Rust >= $FORKD_MIN_RUST found${old:+ (${old#* } in ${old%% *} is too old: rustup update)}, and apt offers none: install Rust with rustup (https://rustup.rs), then re-run"
    note "no Rust >= $FORKD_MIN_RUST${old:+ (found ${old#* } in ${old%% *})}: installing $pkgs from apt"
    # shellcheck disable=SC2086
    apt-get install -y -q --no-install-recommends $pkgs >/dev/null
    find_cargo || die "installed $pkgs, but still no Rust >= $FORKD_MIN_RUST on PATH: install Rust with rustup (https://rustup.rs)"
  fi
  export PATH="$CARGO_DIR:$PATH"
  note "Rust $(rust_version "$CARGO_DIR") ($CARGO_DIR/cargo${RUSTUP_HOME:+, RUSTUP_HOME=$RUSTUP_HOME})"
}

# ---- step timing ----------------------------------------------------------
STEP_TIMES=()
# step NAME CMD...: runs CMD, prints and records how long it took.
step() {
  local name=$1 t0=$SECONDS; shift
  "$@"
  local dt=$(( SECONDS - t0 ))
  STEP_TIMES+=("$name:$dt")
  note "[$name: ${dt}s]"
}
# step_summary TITLE: each recorded step's time and the total.
step_summary() {
  local s total=0
  for s in "${STEP_TIMES[@]}"; do total=$(( total + ${s##*:} )); done
  say "$1 in ${total}s"
  for s in "${STEP_TIMES[@]}"; do printf '    %-24s %5ss\n' "${s%:*}" "${s##*:}"; done
}
