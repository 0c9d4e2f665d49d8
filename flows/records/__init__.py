import rlhf  # noqa: F401  (the run's CPU numerics, applied before torch loads: rlhf/numerics.py)
