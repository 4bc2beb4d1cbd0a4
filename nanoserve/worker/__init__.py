"""The model-worker process: owns the engine, speaks typed messages over ZMQ."""
