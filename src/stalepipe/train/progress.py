"""A one-line progress bar (tqdm) with loss, val loss and tokens/s; silent when disabled."""

from __future__ import annotations

import math
import sys

from tqdm import tqdm


class Progress:
    """Progress over training steps. Updates the postfix at most ~4 times a second."""

    def __init__(
        self, total: int, initial: int = 0, enabled: bool = True, desc: str = "train"
    ) -> None:
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            disable=not enabled,
            dynamic_ncols=True,
            file=sys.stderr,
            mininterval=0.25,
            leave=True,
        )

    def update(self, **postfix: float) -> None:
        shown = {
            k: (f"{v:.4f}" if abs(v) < 1000 else f"{v:.0f}")
            for k, v in postfix.items()
            if v is not None and not math.isnan(v)
        }
        self._bar.set_postfix(shown, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()
