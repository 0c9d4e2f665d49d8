"""The errors a stage raises for its user rather than for a developer: the flow refuses the run
with their message alone. They live apart from the stages so that catching them does not
import the stages' training libraries."""

from __future__ import annotations


class StageUserError(RuntimeError):
    """Raised by a stage for its user: the flow shows the message alone, and a multi-process
    launch hands it back to the caller as it was raised."""


class RewardGateError(StageUserError):
    """The trained model is not good enough to optimise against; `metrics` holds what was measured."""

    def __init__(self, message: str, metrics: dict[str, float]):
        super().__init__(message)
        self.metrics = metrics

    def __reduce__(self):  # pickled with its figures, across processes
        return type(self), (str(self), self.metrics)


class NonFiniteLossError(StageUserError):
    """The loss became NaN or infinite; the last full-state checkpoint is kept."""


class ChatTemplateError(ValueError):
    """A tokenizer with no chat template, and none given in the stage's config."""
