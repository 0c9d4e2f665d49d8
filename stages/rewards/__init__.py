"""The reward as the stages compute it: the reward model scorer (`scoring`) and Python reward
functions (`functions`)."""
