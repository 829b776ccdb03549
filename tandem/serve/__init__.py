"""tandem.serve: an OpenAI-compatible HTTP server over one engine (`tandem serve MODEL`).

HTTP and protocol only: the engine behind it is `tandem.engine.async_llm.AsyncLLM` (its core in a
process of its own); `build_app` (app.py) makes the FastAPI app; `server.py` runs it under
uvicorn; `cli.py` is the command line.
"""
