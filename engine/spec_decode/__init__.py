"""Speculative decoding: proposers (n-gram lookup, a self-draft), the speculator that decides
who speculates each step, and the verifier's rejection sampling (see `speculator.py`)."""
