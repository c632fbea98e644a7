"""Float8: the scaled products (``products``) and delayed scaling's histories (``history``)."""
