#!/usr/bin/env bash
# Build the mqload load generator (std-only Rust, lives beside the repo in
# ../shared/tools/mqload) into .bench/mqload/release/mqload.
# Uses cargo from PATH or ~/.cargo/bin; failing both, Debian's cargo-web (Rust 1.85;
# bookworm's plain `cargo` package is Rust 1.63, too old for mqload).
set -euo pipefail
cd "$(dirname "$0")/.."

MQLOAD_DIR=${MQLOAD_DIR:-../shared/tools/mqload}
if [[ ! -f $MQLOAD_DIR/Cargo.toml ]]; then
    echo "build-mqload: $MQLOAD_DIR/Cargo.toml not found (mqload lives in shared/tools beside the repo)" >&2
    exit 1
fi

cargo=$(command -v cargo || true)
if [[ -z $cargo && -x ${HOME:-/root}/.cargo/bin/cargo ]]; then
    cargo=${HOME:-/root}/.cargo/bin/cargo
fi
if [[ -z $cargo ]]; then
    bash scripts/ensure-debian-packages.sh cargo:cargo-web
    cargo=$(command -v cargo)
fi

"$cargo" build --release --quiet --manifest-path "$MQLOAD_DIR/Cargo.toml" --target-dir .bench/mqload
test -x .bench/mqload/release/mqload
