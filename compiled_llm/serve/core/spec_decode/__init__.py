"""Speculative decoding: proposals from the request's own tokens (``ngram_proposer``), which
sequences draft how many tokens each step (``speculator``), and the options (``config``)."""
