#!/usr/bin/env bash
# Installs what pfl needs on a fresh Debian/Ubuntu machine with Python 3.11:
#   - Debian's dataset-fashion-mnist (the real Fashion-MNIST files, no download at run time)
#   - the pfl package and its Python dependencies
#   - with --test: the test tools, and Debian's postgresql (the tests start their own PostgreSQL
#     server in a temporary folder; no system-wide database is created or started)
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")"

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

sudo_cmd=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo_cmd="sudo"
apt_updated=""
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  [ -n "$apt_updated" ] || { $sudo_cmd apt-get update -qq; apt_updated=1; }
  $sudo_cmd apt-get install -y -qq "$@"
}

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  if command -v apt-get >/dev/null; then
    apt_install dataset-fashion-mnist
  else
    echo "setup.sh: no apt-get; put the Fashion-MNIST idx files in \$PFL_DATA_DIR instead" >&2
  fi
fi

if [ -n "$extras" ] && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  if command -v apt-get >/dev/null; then
    # postgresql-common first, told not to create (and start) a system-wide "main" cluster
    apt_install postgresql-common
    $sudo_cmd sed -ri 's/^#?\s*create_main_cluster\s*=.*/create_main_cluster = false/' \
      /etc/postgresql-common/createcluster.conf
    apt_install postgresql
  else
    echo "setup.sh: no apt-get; the PostgreSQL tests are skipped unless initdb and pg_ctl are on PATH" >&2
  fi
fi

python3 -m pip install -q --disable-pip-version-check -e ".${extras}"
