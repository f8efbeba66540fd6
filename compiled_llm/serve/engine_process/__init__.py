"""The engine process and the two sides of its channel. ``compiled-llm serve`` runs the engine
(``LLMEngine``) in a process of its own (engine core); the HTTP process talks to it through the
client (engine core client, async engine) over a pipe (message channel) carrying the messages of
engine messages, or to several replicas of it (dp client, dp router, dp placement). ``LLM`` over
data-parallel replicas drives them the same way, from blocking calls (sync client). Modules named
here run in the front end's process except engine_core.py."""
