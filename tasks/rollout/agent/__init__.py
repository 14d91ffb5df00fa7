"""The agent endpoint: agents as rollouts (`--agent-function-path module:fn`), trained through a loopback server
that records every model call's tokens. What an agent function is given and returns: proxy.py; protocol,
tool-call format, statuses: docs/agents.md.

Split by concern, each module importing only those above it:
- render.py: the neutral message form, tool calls parsed from the model's text, the chat template;
- session.py: the session's token list (token in, token out; a history that only grows);
- api.py, what an API shape is (an `Adapter`), and one adapter per shape: openai.py (chat completions,
  completions), responses.py (the Responses API), anthropic.py (Anthropic's Messages API);
- server.py: the loopback server, per-session keys, streaming;
- proxy.py: the generate function that runs the agent for a sample.
"""
