"""Handing float8 amax histories to the products that take one (delayed scaling, see
:mod:`autocast._src.fp8.history`).

The interpreter's :class:`~autocast._src.transform.interpreter.Context` carries a
:class:`Slots`; each float8 product with delayed scaling takes the next slot from it in the
order ``amp`` binds them: its history and its inbox (where the backward pass writes what it
measured), and whether the slot was ever measured. A handler that re-traces a body (a scan, a
checkpoint) first counts what the body takes, with a :class:`Slots` holding nothing, then
traces it again with the slots' arrays as extra inputs of the body: for a scan, one per
iteration, stacked on a leading axis.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

# columns of an inbox: the exponent bins of an amax and a count of uses (autocast._src.fp8.products)
from autocast._src.fp8.products import INBOX


class Taken(NamedTuple):
    """One product's slot: its history ``(3, n)``, its inbox ``(3, INBOX)``, and which of
    its rows (left operand, right operand, output gradient) were measured; a row that was not
    keeps current scaling."""

    history: Any
    inbox: Any
    measured: tuple[bool, bool, bool]


def inbox_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """The inbox shape that goes with a history of ``shape`` (stacked alike)."""
    return (*tuple(shape)[:-1], INBOX)


class Slots:
    """The slots of one evaluation, handed out in order.

    ``rows`` (pairs of history and inbox) None counts instead: every product then keeps
    current scaling, and ``shapes`` records the history shape each would have taken.
    ``measured`` flags each slot's rows (all measured when None). ``measuring``: the products scale
    from this step's amax (to make a first history).
    """

    def __init__(
        self,
        rows: Sequence[tuple[Any, Any]] | None = None,
        measuring: bool = False,
        measured: Sequence[tuple[bool, bool, bool]] | None = None,
    ) -> None:
        self.rows = rows
        self.measuring = measuring
        self.measured = measured
        self.shapes: list[tuple[int, ...]] = []

    @property
    def taken(self) -> int:
        return len(self.shapes)

    def counter(self) -> Slots:
        """An empty :class:`Slots` to count a body's products with, measuring as this one."""
        return Slots(None, self.measuring)

    def take(self, shape: Sequence[int]) -> Taken | None:
        """The next slot, its history of shape ``shape``; None while counting."""
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
        history, inbox = self.rows[i]
        if tuple(np.shape(history)) != shape or tuple(np.shape(inbox)) != inbox_shape(shape):
            raise ValueError(
                f"amp_fp8_delayed: history {i} has shape {tuple(np.shape(history))}, expected "
                f"{shape}; make the Fp8History with this function's init"
            )
        return Taken(
            history, inbox, (True, True, True) if self.measured is None else self.measured[i]
        )

    def check_all_taken(self) -> None:
        if self.rows is not None and self.taken != len(self.rows):
            raise ValueError(
                f"amp_fp8_delayed: the Fp8History has {len(self.rows)} histories but the program "
                f"has {self.taken} float8 products that take one; make it with init on "
                "arguments of these shapes"
            )
