"""The demo's tool world written as an agent program, a plain openai-SDK loop: it asks the model, runs the
`preferences` tool the model calls, and asks again, until the model answers without a call. It imports
nothing of the project; `configs/tools-agent.yaml` trains it (`environment.agent: tools_agent:run`, this
folder in `ppo.paths`), the config's reward terms scoring the final answer (docs/agents.md).
"""

from __future__ import annotations

PREFERENCES = {"type": "function", "function": {
    "name": "preferences", "description": "Look up which adjectives this user likes to hear about a subject.",
    "parameters": {"type": "object", "properties": {
        "subject": {"type": "string", "description": "the thing the user asked about."}}, "required": ["subject"]},
    "return": {"type": "string"}}}
MAX_TURNS = 3


async def run(row: dict, client) -> float:
    """One episode: the prompt record's conversation, the tool answering from its `liked` column."""
    messages = list(row["messages"])
    likes = "likes: " + ", ".join(row["liked"].split())
    for _ in range(MAX_TURNS):
        completion = await client.chat.completions.create(model="policy", messages=messages, tools=[PREFERENCES])
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            answer = likes if call.function.name == "preferences" else f"error: no tool {call.function.name!r}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": answer})
    return 0.0  # the reward is the config's terms on the final answer
