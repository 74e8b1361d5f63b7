"""The loop: sampling, folding, deciding and dispatching each step to the edge; and its wiring."""
