"""Handing float8 amax histories to the products that take one (delayed scaling, see
:mod:`autocast._src.fp8_history`).

The interpreter's :class:`~autocast._src.transform.interpreter.Context` carries a
:class:`Slots`; each float8 product with delayed scaling takes the next history from it in the
order ``amp`` binds them. A handler that re-traces a body (a scan, a checkpoint) first counts
what the body takes, with a :class:`Slots` holding no histories, then traces it again with the
histories as extra inputs of the body: one per iteration for a scan, stacked on a leading axis.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


class Slots:
    """The histories of one evaluation, handed out in order.

    ``rows`` None counts instead: every product then keeps current scaling, and ``shapes``
    records the shape of history each would have taken. ``measuring``: the products scale
    from this step's amax and return it as their history (for the first one).
    """

    def __init__(self, rows: Sequence[Any] | None = None, measuring: bool = False) -> None:
        self.rows = rows
        self.measuring = measuring
        self.shapes: list[tuple[int, ...]] = []

    @property
    def taken(self) -> int:
        return len(self.shapes)

    def counter(self) -> Slots:
        """An empty :class:`Slots` to count a body's products with, measuring as this one."""
        return Slots(None, self.measuring)

    def take(self, shape: Sequence[int]) -> Any:
        """The next history, of shape ``shape``; None while counting."""
        i, shape = self.taken, tuple(shape)
        self.shapes.append(shape)
        if self.rows is None:
            return None
        if i >= len(self.rows):
            raise ValueError(
                f"amp_fp8_delayed: the Fp8History has {len(self.rows)} histories but the "
                "program has more float8 products; make it with init on arguments of these "
                "shapes"
            )
        row = self.rows[i]
        if tuple(np.shape(row)) != shape:
            raise ValueError(
                f"amp_fp8_delayed: history {i} has shape {tuple(np.shape(row))}, expected "
                f"{shape}; make the Fp8History with this function's init"
            )
        return row

    def check_all_taken(self) -> None:
        if self.rows is not None and self.taken != len(self.rows):
            raise ValueError(
                f"amp_fp8_delayed: the Fp8History has {len(self.rows)} histories but the program "
                f"has {self.taken} float8 products that take one; make it with init on "
                "arguments of these shapes"
            )
