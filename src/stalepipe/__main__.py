"""`python -m stalepipe` (what `torchrun -m stalepipe` runs) is the `stalepipe` CLI."""

import os
import sys

from stalepipe.cli import main

code = main()
if "torch" in sys.modules:  # only a command that ran something imported torch (--help does not)
    from stalepipe.training.peers.topology import under_torchrun

    if under_torchrun():
        # A torchrun worker whose process group is already destroyed: leave without the C++
        # teardown at interpreter exit, which aborted about one run in eight here ("terminate
        # called without an active exception", SIGABRT after a successful run, gloo, torch
        # 2.13).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
sys.exit(code)
