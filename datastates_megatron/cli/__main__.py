"""``python -m datastates_megatron.cli``: the ``datastates-ckpt`` console script."""

import sys

from . import main

sys.exit(main())
