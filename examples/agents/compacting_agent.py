"""The demo's tool world as an agent that compacts its context, as long-running agents do: after each tool
round it starts a fresh conversation, the user's question and a note of what the tools said, instead of
growing the transcript. Each fresh conversation is a rewritten history, so its episodes train as chains
(docs/agents.md, "History rewritten"). Like tools_agent.py it imports nothing of the project.
"""

from __future__ import annotations

from tools_agent import MAX_TURNS, PREFERENCES


async def run(row: dict, client) -> float:
    """One episode: ask; run the calls; ask again on a compacted context; until an answer without a call."""
    question = list(row["messages"])
    messages, notes = question, []
    likes = "likes: " + ", ".join(row["liked"].split())
    for _ in range(MAX_TURNS):
        completion = await client.chat.completions.create(model="policy", messages=messages, tools=[PREFERENCES])
        message = completion.choices[0].message
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            said = likes if call.function.name == "preferences" else "no such tool"
            notes.append(f"{call.function.name} said: {said}")
        messages = [*question, {"role": "user", "content": "Notes so far: " + "; ".join(notes)}]
    return 0.0  # the reward is the config's terms on the final answer
