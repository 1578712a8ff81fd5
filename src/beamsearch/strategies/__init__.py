"""Search strategies: sampling.py (greedy, multinomial), beam.py (beam search, beam sampling)."""
