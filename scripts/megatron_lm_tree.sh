#!/usr/bin/env bash
# Unpack a fresh copy of an unmodified Megatron-LM tree from ../shared/megatron-lm into DEST, check
# it against SHA256SUMS, apply our patch (not with --no-patch: a tree for the runtime hook), and
# print the tree's path (DEST/core_vVERSION, or DEST/main-DATE for a snapshot of main).
#
#   scripts/megatron_lm_tree.sh [--no-patch] VERSION DEST      e.g. 0.16.1 /tmp/mlm
#   scripts/megatron_lm_tree.sh [--no-patch] main-DATE DEST    e.g. main-2026-08-22 /tmp/mlm
#
# The trees CI tests are the `source` column of datastates_megatron/megatron/megatron_lm/versions.py.
# Exit status: 0 done, 1 checksum or patch failure, 2 usage or no such tarball.
set -euo pipefail
patch=1
[[ ${1:-} != --no-patch ]] || { patch=0; shift; }
[[ $# -eq 2 ]] || { echo "usage: $0 [--no-patch] VERSION DEST" >&2; exit 2; }
version=$1 dest=$2
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
shared=${DSM_SHARED_DIR:-$repo/../shared}/megatron-lm
case $version in
    main-*) name=$version ;;
    *) name=core_v$version ;;
esac
tarball=megatron-lm-$name.tar.gz
[[ -f $shared/$tarball ]] || { echo "error: $shared/$tarball not found" >&2; exit 2; }
(cd "$shared" && grep " $tarball\$" SHA256SUMS | sha256sum -c --quiet -) \
    || { echo "error: $shared/$tarball does not match SHA256SUMS" >&2; exit 1; }
mkdir -p "$dest"
tree=$dest/$name
[[ ! -e $tree ]] || { echo "error: $tree exists; pass an empty DEST" >&2; exit 2; }
tar -xzf "$shared/$tarball" -C "$dest"
[[ $patch == 0 ]] || bash "$repo/scripts/apply_patches.sh" "$tree" >&2
echo "$tree"
