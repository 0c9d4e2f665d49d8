"""Config, the demo world, the stack and MLflow conventions. Importing the package applies the run's
CPU numerics before torch can load (rlhf/numerics.py)."""

from rlhf import numerics

numerics.apply()
