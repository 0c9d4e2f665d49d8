"""A sandbox for the code a policy writes: untrusted Python (or shell) in a child process confined by kept
Linux mechanisms, no container daemon needed (docs/sandbox.md). `code` is what users name (`run_python`,
the reward function `tests_pass`, the tool `python_tools`); `local` is the parent's side of a run (the
working directory, output bounds, the wall clock, the group kill); `confine` the child's (rlimits, the
`nobody` user, Landlock, seccomp, a network namespace). Imports nothing else of the project.
"""
