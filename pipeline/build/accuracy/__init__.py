"""PyTorch baselines (reference.py, reference_decoder.py), the comparisons and gates (metrics.py), and the memo that
lets validation reuse the search's held-out measurement of the same graph (measured.py)."""
