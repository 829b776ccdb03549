"""The generation engine: sequences, blocks, scheduling, the worker that owns the device, output
processing, the offline API (`LLM`), and the engine core with its clients and `AsyncLLM` (the
engine in a process of its own, as servers use it). docs/architecture.md has the map."""
