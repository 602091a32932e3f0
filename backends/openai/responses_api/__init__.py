"""OpenAI's Responses API, ``POST /v1/responses``, as vLLM 0.26 serves it: a request run as the chat completion it
amounts to (``request``), answered as a Response object or its stream of events (``shape``, ``schemas``), by its
route (``route``)."""
