"""Moving weights into the engine: the colocated trainer's in-process copy with its check
(`sync`), and server mode's NCCL push (`communicator`: the two-party group both sides join;
`receiver`: the engine core's side, which receives and loads)."""
