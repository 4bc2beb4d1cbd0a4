"""The serving benchmark harness behind `nanoserve bench`.

It starts each server under comparison (an "arm": nanoserve, the transformers baseline in
`hf_server`, vLLM, or any OpenAI-compatible server by URL or start command) on a dummy-weight
checkpoint from `models`, sends every arm the same streamed greedy requests of a workload
(`workloads`: scoreboard, concurrency sweep, autocomplete typing, shared prefixes) through the
timing client in `client`, summarizes TTFT, ITL, TPOT and throughput (`metrics`), and writes one
comparison table per workload as markdown, JSON and plots (`report`, `plots`, `results`). The
scripts and recorded results in the repository's `benchmarks/` folder build on these modules.
"""
