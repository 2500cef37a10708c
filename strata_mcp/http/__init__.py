"""The local OpenAI- and Anthropic-compatible endpoint: one starlette app (app.py) with a module per API
(openai.py, anthropic.py), the request -> engine part they share (generation.py, tool_calls.py), and the
uvicorn server that runs it on a thread of the MCP server's own process (serving.py), so both share the
one loaded model."""
