"""The OpenAI-compatible HTTP front of pagedchat: routes over any EngineClient, the remote client
for engine pods, and the `python -m server` entry point."""
