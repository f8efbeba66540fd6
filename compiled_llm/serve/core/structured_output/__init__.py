"""Grammar-constrained decoding on the host: schemas and grammars checked and compiled (with
xgrammar, off the step loop), and each structured sequence's matcher, which says which tokens
may come next (a bitmask the worker applies to the logits on the device) and follows the tokens
the sequence gets."""
