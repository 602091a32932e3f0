"""The OpenAI-compatible HTTP API: a process beside tritonserver (FastAPI + uvicorn) that turns OpenAI requests into
orchestrator requests over Triton's gRPC streaming API (docs/openai.md).

``app`` the routes; ``generation`` the generation routes' common path; ``responses_api`` ``POST /v1/responses``;
``schemas`` and ``sampling_fields`` the request bodies, ``response_schemas`` the response bodies; ``convert`` a
request -> the orchestrator's inputs; ``media_fetch`` http(s) media; ``orchestrator_client`` the gRPC side;
``responses`` the orchestrator's responses -> OpenAI's bodies; ``errors`` OpenAI's error shape and statuses;
``config`` the settings; ``process`` the API as a child process (the launcher's and the tests').
"""
