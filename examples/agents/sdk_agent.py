"""The demo's tool world written with the OpenAI Agents SDK (`openai-agents`), a framework agent: an
`Agent` with one `function_tool`, run by the SDK's `Runner` on the chat-completions model it is handed.
It imports nothing of the project; `configs/tools-agent-sdk.yaml` trains it (`environment.agent:
sdk_agent:run`, this folder in `ppo.paths`), the config's reward terms scoring the final answer
(docs/agents.md).
"""

from __future__ import annotations

from agents import Agent, MaxTurnsExceeded, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool

MAX_TURNS = 3


async def run(row: dict, client) -> float:
    """One episode: the prompt record's conversation, the tool answering from its `liked` column."""
    likes = "likes: " + ", ".join(row["liked"].split())

    @function_tool
    def preferences(subject: str) -> str:
        """Look up which adjectives this user likes to hear about a subject.

        Args:
            subject: the thing the user asked about.
        """
        return likes

    agent = Agent(name="describer", tools=[preferences],
                  model=OpenAIChatCompletionsModel(model="policy", openai_client=client))
    try:  # no traces sent anywhere: the run stays on this machine
        await Runner.run(agent, list(row["messages"]), max_turns=MAX_TURNS,
                         run_config=RunConfig(tracing_disabled=True))
    except MaxTurnsExceeded:
        pass  # the policy kept calling: the episode ran out of turns, as the built-in loop's would
    return 0.0  # the reward is the config's terms on the final answer
