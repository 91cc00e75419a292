#!/usr/bin/env bash
# Installs what pfl needs on a fresh Debian/Ubuntu machine with Python 3.11:
#   - Debian's dataset-fashion-mnist (the real Fashion-MNIST files, no download at run time)
#   - the pfl package and its Python dependencies (with --test: also the test tools)
# Safe to run again: it skips what is already there.
set -euo pipefail
cd "$(dirname "$0")"

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"

if [ ! -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]; then
  sudo_cmd=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo_cmd="sudo"
  if command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    $sudo_cmd apt-get update -qq
    $sudo_cmd apt-get install -y -qq dataset-fashion-mnist
  else
    echo "setup.sh: no apt-get; put the Fashion-MNIST idx files in \$PFL_DATA_DIR instead" >&2
  fi
fi

python3 -m pip install -q --disable-pip-version-check -e ".${extras}"
