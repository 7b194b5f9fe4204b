#!/usr/bin/env bash
# Builds the plugin as it was at an earlier commit (the upgrade tests' previous release) into
# OUT: a git worktree of that commit under target/, built with its own target directory so
# that this checkout's build is untouched.
#
#   tools/build_release.sh <commit> <out.wasm>
set -euo pipefail
commit=$1
out=$2
root=$(git rev-parse --show-toplevel)
if ! git cat-file -e "$commit^{commit}" 2>/dev/null && [ "$(git rev-parse --is-shallow-repository)" = true ]; then
  # A shallow clone (CI's, say): fetch the history the previous release is in.
  git fetch --quiet --unshallow || true
fi
if ! git cat-file -e "$commit^{commit}" 2>/dev/null; then
  echo "build_release: commit $commit is not in this clone, and fetching the history did not bring it" >&2
  exit 1
fi
tree=$root/target/release-src-$commit
git worktree prune
rm -rf "$tree"
git worktree add --quiet --detach "$tree" "$commit"
trap 'git worktree remove --force "$tree"' EXIT
(cd "$tree" && CARGO_TARGET_DIR="$root/target/previous" cargo build --quiet --target wasm32-wasip1 --release --lib)
mkdir -p "$(dirname "$out")"
cp "$root/target/previous/wasm32-wasip1/release/idempotency.wasm" "$out"
echo "built $out from $commit"
