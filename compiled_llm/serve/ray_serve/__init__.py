"""Serving on Ray Serve: engine replicas behind one OpenAI endpoint (``pip install compiled_llm[ray]``).

    app.py             the application: the engine replicas (each the OpenAI server's own app over
                       an engine) and the ingress that forwards every request to one of them
    request_router.py  Ray Serve's request router for the engine replicas: prefix-aware
    prefix_routing.py  which replica a prompt goes to: the one sent its prefix, else the least
                       loaded (plain Python; a data-parallel router can use it the same way)
    asgi_forward.py    an HTTP request carried to a replica and run through the app there

``app`` and ``request_router`` import Ray; this package's ``__init__`` imports nothing, so the
rest of compiled_llm never loads Ray.
"""
