"""See autocast._src."""
