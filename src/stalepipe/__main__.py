"""`python -m stalepipe` (what `torchrun -m stalepipe` runs) is the `stalepipe` CLI."""

import sys

from stalepipe.cli import main

sys.exit(main())
