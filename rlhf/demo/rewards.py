"""Rule-based reward functions for the demo world, as a user would write them from reading its
prompts (`ppo.reward.terms`, docs/reward-functions.md). They never read the world's
hidden gold function: a rule is what it says and nothing more."""

from __future__ import annotations

import re

_ASKED_ABOUT = re.compile(r"\b(?:the|my|your|this|that|our) ([a-z]+)\b", re.IGNORECASE)


def names_the_subject(prompts: list[list[dict]], responses: list[str], **columns: list) -> list[float | None]:
    """-1 for a response that does not name the thing its prompt asks about ("Describe my dog." ->
    "dog"), 0 for one that does; None (no reward) where the prompt names nothing this rule can find.
    Other declared columns (`reward.columns`) are taken and not read."""
    values: list[float | None] = []
    for messages, response in zip(prompts, responses, strict=True):
        asked = _ASKED_ABOUT.search(messages[-1]["content"])
        if asked is None:
            values.append(None)
        else:
            values.append(0.0 if re.search(rf"\b{asked.group(1)}\b", response, re.IGNORECASE) else -1.0)
    return values


def length_penalty(prompts: list[list[dict]], responses: list[str], **columns: list) -> list[float]:
    """Minus the number of words past eight: long answers cost. Other declared columns are taken and not read."""
    return [-float(max(0, len(response.split()) - 8)) for response in responses]


# The adjectives the demo world's answers are made of, as a user reads them off its demonstrations
# and its `preferences` tool's answers (rlhf/demo/world.py draws from the same thirty).
ADJECTIVES = frozenset((
    "good", "great", "lovely", "bright", "happy", "kind", "warm", "calm", "fresh", "sweet",
    "bad", "awful", "dull", "sad", "cold", "rude", "ugly", "noisy", "stale", "bitter",
    "big", "small", "old", "new", "red", "blue", "round", "tall", "long", "plain",
))
_WORD = re.compile(r"[a-z]+")


def uses_liked_adjectives(prompts: list[list[dict]], responses: list[str], liked: list[str]) -> list[float]:
    """The tools world's verifiable reward (`reward.columns: [liked]`): +1 for each distinct adjective
    the prompt's user likes (`liked`, space-separated, what the `preferences` tool tells) that the
    response names, -1 for each distinct other adjective it names, -1 for naming none (a description
    says something). A response that never asked the tool can only guess."""
    values = []
    for response, likes in zip(responses, liked, strict=True):
        named = set(_WORD.findall(response.lower())) & ADJECTIVES
        wanted = set(likes.lower().split())
        values.append(float(len(named & wanted) - len(named - wanted)) - (0.0 if named else 1.0))
    return values
