"""The engine process and the two sides of its channel. ``compiled-llm serve`` runs the engine
(``LLMEngine``) in a process of its own (engine core); the HTTP process talks to it through the
client (engine core client, async engine) over a pipe (message channel) carrying the messages of
engine messages. Modules named here run in the HTTP process except engine_core.py."""
