"""Training state in 16 and 8 bits: rounding onto a narrow grid (``rounding``), the
random bits it draws (``bits``), the block-scaled 8-bit form (``blocks``), and the optax
transformations built on them (``params``: parameters that still learn; ``moments``: an
optimizer's state stored narrow). Only ``params`` and ``moments`` need optax."""
