"""The model-worker process, child side only: its entry point (`main`), the engine loop it
shares with the in-process client (`loop`), its heartbeat, its end of the ZMQ sockets and the
rank-side code of tensor parallelism. The front's handle on it is `nanoserve/client/`."""
