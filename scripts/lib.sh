# Shared helpers for forkd's scripts. Source it; do not run it.

# Data dir: everything forkd keeps lands here (docs/data-dir.md).
FORKD_HOME=${FORKD_HOME:-/var/lib/forkd}
REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

say() { printf '\033[1m==> %s\033[0m\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

need_root() {
  [ "$(id -u)" = 0 ] || die "$1 must run as root (try: sudo $0)"
}
