"""Where the launcher's ranks start: forked from a server that has imported torch and the
training code once (multiprocessing's forkserver), so a rank starts in a fraction of a second
instead of importing torch again (seconds of CPU a rank, each launch). Light to import: the
command line starts the server (`start_rank_server`) before it imports the launcher, so the
server's imports run beside the launcher's own set-up instead of after it."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver

# __main__ as spawn would import it (a script's own rank functions), then the training code,
# and torch._dynamo: torch imports it lazily at a process's first model built on the meta
# device or first optimizer step (`torch._compile._disable_dynamo`), 2-4 s of CPU a rank
PRELOAD = ["__main__", "stalepipe.training.launch.train", "torch._dynamo"]


def rank_context() -> mp.context.BaseContext:
    """The ranks' start method: forkserver, preloading `PRELOAD`; where there is none,
    spawn. Never plain fork: the launcher may hold threads (a store, a notebook's)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_rank_server() -> None:
    """Start the ranks' server now (it starts at the first rank otherwise); nothing where
    ranks are spawned."""
    if rank_context().get_start_method() == "forkserver":
        forkserver.ensure_running()
