"""tandem.serve: an OpenAI-compatible HTTP server over one engine (`tandem serve MODEL`).

`AsyncLLM` (async_engine.py) runs the engine in its own thread; `build_app` (app.py) makes the
FastAPI app; `server.py` runs it under uvicorn; `cli.py` is the command line.
"""
