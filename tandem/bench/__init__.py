"""tandem.bench: online load against any OpenAI-compatible server (serve, sweep), the GPU monitor,
the interconnect probe, and one result schema ("tandem.bench/1", see report.py) for all of them.

Modules are imported where used, so `import tandem.bench.gpu_monitor` stays light.
"""
