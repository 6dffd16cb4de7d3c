"""Speculative decoding: the draft tree, verification, sampling, the decode loop."""
