"""The RL stage's reward, `ppo.reward` and `ppo.teacher`: the terms whose weighted sum scores each
response (the reward model, Python functions, servers, DAPO's overlong penalty) and the teacher whose
per-token log-probs grade every token the policy samples (on-policy distillation)."""

from __future__ import annotations

import re
from typing import ClassVar, Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from rlhf.sections.base import RemoteRewardConfig, _Frozen


class RewardTerm(_Frozen):
    """One term of the RL stage's reward: the reward model handed down by the reward stage, a Python
    function, or a server (`remote`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """How the term is logged (`rollout/reward/<name>`) and shown in the samples table."""
    weight: float = 1.0
    """Its weight in the score the stage uses: the weighted sum of every term."""
    function: str | None = None
    """`module:function` scoring a batch's responses (a float or None each); unset, no `remote`: the reward model."""
    remote: RemoteRewardConfig | None = None
    """A server that scores the responses: a scoring endpoint or an LLM judge; unset: not remote."""

    @property
    def is_model(self) -> bool:
        """Whether this term is the reward model handed down by the reward stage."""
        return self.function is None and self.remote is None


class OverlongConfig(_Frozen):
    """DAPO's soft overlong penalty, a reward term (`overlong`): 0 for a response up to `buffer`
    tokens short of `sampling.response_length`, then falling linearly to -1 at the limit."""

    buffer: PositiveInt = 4
    """L_cache: the last this many tokens before the length limit, over which the penalty falls from 0 to -1."""
    weight: PositiveFloat = 1.0
    """Its weight in the score (DAPO's penalty factor)."""


class RewardTermsConfig(_Frozen):
    """What the RL stage's score is: the weighted sum of its terms."""

    MERGED: ClassVar[dict[str, str]] = {
        "paths": "ppo.paths: the folders in front of the import path for every module:function the stage names",
    }
    terms: list[RewardTerm] = [RewardTerm(name="reward_model")]
    """The terms; at most one is the reward model (no `function` or `remote`); empty: the teacher's term alone."""
    columns: list[str] = []
    """Extra columns of the `prompts` records (e.g. `answer`) that every record must have and the functions receive."""
    sees_reasoning: bool = False
    """Whether the terms score an episode's last turn with its reasoning block; by default they see the answer alone."""
    overlong: OverlongConfig | None = None
    """DAPO's soft overlong penalty as a term named `overlong` (`rollout/reward/overlong`); unset: none."""

    @model_validator(mode="after")
    def _terms_are_distinct(self) -> RewardTermsConfig:
        """Each term under a name of its own (`overlong` taken by `reward.overlong`); none only beside a
        teacher (`PPOConfig` checks)."""
        names = [term.name for term in self.terms]
        if len(set(names)) < len(names):
            raise ValueError(f"reward.terms: names must differ, got {names}")
        if self.overlong is not None and OVERLONG_TERM in names:
            raise ValueError(f"reward.terms: {OVERLONG_TERM!r} is the name of reward.overlong's term; rename yours")
        return self

    @model_validator(mode="after")
    def _terms_are_well_formed(self) -> RewardTermsConfig:
        """At most one term is the reward model; a term is a function or a server, not both; a function is named."""
        if sum(term.is_model for term in self.terms) > 1:
            raise ValueError("reward.terms: at most one term is the reward model (one without `function` or `remote`)")
        for term in self.terms:
            if term.function is not None and term.remote is not None:
                raise ValueError(f"reward.terms[{term.name}]: a term is a `function` or a `remote` server, not both")
            if term.function is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", term.function):
                raise ValueError(f"reward.terms[{term.name}].function: {term.function!r} is not 'module:function'")
        return self

    @property
    def uses_model(self) -> bool:
        """Whether a reward model scores (a term without `function` or `remote`)."""
        return any(term.is_model for term in self.terms)

    @property
    def functions(self) -> list[RewardTerm]:
        return [term for term in self.terms if term.function is not None]

    @property
    def remotes(self) -> list[RewardTerm]:
        return [term for term in self.terms if term.remote is not None]

    @property
    def pairwise(self) -> list[RewardTerm]:
        """The judges that compare each response with a response of the SFT policy (`parse: choice`)."""
        return [term for term in self.remotes if term.remote.pairwise]

    @property
    def weights(self) -> dict[str, float]:
        """Each term's weight by name, the overlong penalty's included: what the score sums."""
        overlong = {OVERLONG_TERM: self.overlong.weight} if self.overlong is not None else {}
        return {term.name: term.weight for term in self.terms} | overlong


class TeacherConfig(_Frozen):
    """On-policy distillation: a frozen teacher grades every token the policy samples. Its term in each
    token's reward is `weight x -KL_t`, KL_t the `kl_estimator`'s estimate of KL(policy || teacher) at the
    sampled token: with k1, `weight x (log p_teacher - log p_policy)` (docs/methods.md, "On-policy
    distillation"). With `top_k` it is a loss term instead, the exact KL over k + 1 bins at every sampled
    position, differentiated through the policy's logits (GKD's way). The teacher must share the
    policy's tokenizer: it reads the policy's token ids."""

    MERGED: ClassVar[dict[str, str]] = {
        "trust_remote_code": "ppo.trust_remote_code allows every model the stage loads its own code: the policy's, "
                             "the reward model's and the teacher's",
    }

    model: str
    """The teacher: a folder, hub id, `demo:<name>`, `runs:/<run id>/<path>` or `models:/<name>@<alias>` (`/<n>`)."""
    weight: PositiveFloat = 1.0
    """Its weight in each token's reward (beside the reward's terms, which score whole responses)."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """The per-token estimate of KL(policy || teacher): k1 the log-ratio (the published recipe), k3 (never negative)."""
    top_k: PositiveInt | None = None
    """A loss instead of a reward: `weight x` KL(policy || teacher) over the teacher's top-k tokens and the rest."""


OVERLONG_TERM = "overlong"
"""The name of `reward.overlong`'s term."""
