"""Float8: the products with one scale per tensor (``products``), with a scale per row or per
block (``finer_scaling``), what both share (``numerics``), and delayed scaling's histories
(``history``)."""
