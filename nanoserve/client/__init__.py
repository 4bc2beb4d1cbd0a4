"""The front's handle on engines: the engine client (in-process or over ZMQ to a worker
process), supervision and restarts, data parallelism and its router, headless nodes."""
