"""The OpenAI API family: completions, chat completions, the Responses API and tool calls."""
