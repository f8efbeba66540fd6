"""An OpenAI-compatible HTTP server over one engine (``compiled-llm serve``): FastAPI routes in
``api_server``, request and response shapes in ``protocol``, the conversions between API
requests and engine requests in ``serving_completions`` and ``serving_chat``."""
