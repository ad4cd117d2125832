#!/usr/bin/env bash
# Apply (or check, or revert) the datastates-megatron --lazy-ckpt patch to a Megatron-LM checkout.
#
#   scripts/apply_patches.sh MEGATRON_DIR            apply (prints "already applied" if it is)
#   scripts/apply_patches.sh MEGATRON_DIR --check    only say whether it applies / is applied
#   scripts/apply_patches.sh MEGATRON_DIR --revert   undo it (prints "not applied" if it is not)
#
# The version is read from MEGATRON_DIR/megatron/core/package_info.py (MAJOR/MINOR/PATCH) and picks
# patches/megatron-lm-core_v*.patch. MEGATRON_DIR may be a git checkout or a plain copy without
# .git (e.g. from `git archive`); only its work tree is changed, nothing is staged or committed.
# Exit status: 0 done (or nothing to do), 1 the patch does not apply, 2 usage/unsupported version.
set -euo pipefail

usage() {
    echo "usage: $0 MEGATRON_DIR [--check|--revert]" >&2
    exit 2
}

[[ $# -ge 1 && $# -le 2 ]] || usage
megatron_dir=$1
mode=${2:-apply}
case "$mode" in
    apply|--check|--revert) ;;
    *) usage ;;
esac

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_dir=$(cd "$script_dir/../patches" && pwd)

# Megatron-LM version (MAJOR.MINOR.PATCH) -> patch file. Each listed version was checked to apply.
supported="0.16.0 0.16.1 0.19.0 0.19.1"
patch_for() {
    case "$1" in
        0.16.0|0.16.1) echo megatron-lm-core_v0.16.1.patch ;;
        0.19.0|0.19.1) echo megatron-lm-core_v0.19.0.patch ;;  # tag core_v0.19.0 says 0.19.1
        *) return 1 ;;
    esac
}

command -v git >/dev/null || { echo "error: git is required (the patch is applied with git apply)" >&2; exit 2; }

if [[ ! -d "$megatron_dir" ]]; then
    echo "error: $megatron_dir is not a directory" >&2
    exit 2
fi
megatron_dir=$(cd "$megatron_dir" && pwd)
info="$megatron_dir/megatron/core/package_info.py"
if [[ ! -f "$info" ]]; then
    echo "error: $info not found: is $megatron_dir a Megatron-LM checkout? (supported versions: $supported)" >&2
    exit 2
fi

field() { sed -n "s/^$1 *= *\([0-9][0-9]*\).*/\1/p" "$info" | head -n1; }
version="$(field MAJOR).$(field MINOR).$(field PATCH)"
if ! patch_name=$(patch_for "$version"); then
    echo "error: Megatron-LM version $version found in $info is not supported; supported versions: $supported" >&2
    exit 2
fi
patch_file="$patch_dir/$patch_name"
[[ -f "$patch_file" ]] || { echo "error: $patch_file is missing" >&2; exit 2; }

# Run git apply in MEGATRON_DIR and never let git discover an enclosing repository: from a
# subdirectory of some other repo, git apply would silently skip every path (paths are taken
# relative to that repo's root). A checkout's own .git is still used; without one git apply runs
# outside any repository, which it supports.
git_apply() {
    (cd "$megatron_dir" && GIT_CEILING_DIRECTORIES=$(dirname "$megatron_dir") git apply "$@" "$patch_file")
}

applies() { git_apply --check >/dev/null 2>&1; }
applied() { git_apply --reverse --check >/dev/null 2>&1; }

# Guard against a git apply that exits 0 but changed nothing.
verify_marker() {
    local expect=$1 f
    for f in megatron/training/arguments.py megatron/training/checkpointing.py megatron/training/async_utils.py; do
        if grep -q datastates_megatron "$megatron_dir/$f"; then
            [[ $expect == present ]] || { echo "error: $f still references datastates_megatron after revert" >&2; exit 1; }
        else
            [[ $expect == absent ]] || { echo "error: $f was not patched" >&2; exit 1; }
        fi
    done
}

tag="Megatron-LM $version at $megatron_dir ($patch_name)"
case "$mode" in
    --check)
        if applied; then
            echo "already applied: $tag"
        elif applies; then
            echo "applies cleanly: $tag"
        else
            echo "error: $patch_name does not apply to $tag:" >&2
            git_apply --check >&2 || true
            exit 1
        fi
        ;;
    apply)
        if applied; then
            echo "already applied: $tag"
            exit 0
        fi
        if ! applies; then
            echo "error: $patch_name does not apply to $tag (locally modified files?):" >&2
            git_apply --check >&2 || true
            exit 1
        fi
        git_apply
        verify_marker present
        echo "applied: $tag"
        ;;
    --revert)
        if ! applied; then
            if applies; then
                echo "not applied: $tag"
                exit 0
            fi
            echo "error: cannot revert $patch_name from $tag: the patched files were modified:" >&2
            git_apply --reverse --check >&2 || true
            exit 1
        fi
        git_apply --reverse
        verify_marker absent
        echo "reverted: $tag"
        ;;
esac
