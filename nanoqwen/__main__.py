"""`python -m nanoqwen ...` (and `torchrun --nproc-per-node N -m nanoqwen ... -tp N`): the nanoqwen
command."""

import sys

from nanoqwen.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
