#!/usr/bin/env bash
# Apply (or check, or revert) the datastates-megatron --lazy-ckpt patch to a Megatron-LM checkout:
# `datastates-ckpt patch` from this source tree, without installing it (needs python3 >= 3.10 and git).
#
#   scripts/apply_patches.sh MEGATRON_DIR            apply (prints "already applied" if it is)
#   scripts/apply_patches.sh MEGATRON_DIR --check    only say whether it applies / is applied
#   scripts/apply_patches.sh MEGATRON_DIR --revert   undo it (prints "not applied" if it is not)
#
# The patch is picked by the version in MEGATRON_DIR/megatron/core/package_info.py from the table of
# tested versions (datastates_megatron/megatron/megatron_lm/versions.py). Exit status: 0 done (or nothing to do),
# 1 the patch does not apply, 2 usage error or untested version. Set PYTHON to choose the interpreter
# (default: the checkout's .venv made by scripts/setup.sh, else python3; any python3 >= 3.10 will do:
# patching needs none of the package's runtime dependencies, e.g. on a login node without torch).
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3}
[[ -n ${PYTHON:-} || ! -x $repo/.venv/bin/python ]] || python=$repo/.venv/bin/python
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "$python" -m datastates_megatron.megatron.megatron_lm.patching "$@"
