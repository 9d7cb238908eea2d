"""``python -m tvm_fusion.cli``: the ``tvm-fusion`` command."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
