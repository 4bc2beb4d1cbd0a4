"""Decoding on a busy machine: why two compute threads collapse when another process holds one
of two cores, and what the adaptive thread count (platforms/cpu/threads.py) makes of it.

    python -m benchmarks.busy_machine [--preset small-fp32] [--tokens 64] [--rounds 3]

For each thread setting (a fixed 2, a fixed 1, and the adaptive default) and each load (quiet;
one busy-looping process; one memory-streaming process), one in-process engine decodes
`--tokens` greedy tokens of one stream; rounds alternate the loads so that the machine's drift
falls on all alike. It prints single-stream decode tok/s (medians) and each setting's busy /
quiet ratio. With a fixed pair of threads, every op's OpenMP barrier waits for the thread whose
core the other process holds: the step time is set by the scheduler's time slices, not by the
arithmetic (the rounds' spread shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nanoserve.bench.background import BackgroundLoad, running
from nanoserve.bench.models import make_dummy_checkpoint

SETTINGS = {"2 threads": ("2", "0"), "1 thread": ("1", "0"), "adaptive (default)": ("2", "1")}
LOADS = {
    "quiet": BackgroundLoad(),
    "1 busy core": BackgroundLoad(cpu_hogs=1),
    "memory traffic": BackgroundLoad(memory_hogs=1),
}

# Run in a fresh interpreter per setting: OMP_NUM_THREADS is read when OpenMP starts.
MEASURE = """
import json, sys, time
from nanoserve import LLM, SamplingParams
model, num_tokens = sys.argv[1], int(sys.argv[2])
llm = LLM(model, max_model_len=1024)
params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
llm.generate([[1, 2, 3]], params)  # warm-up, and the governor's first probes
started = time.perf_counter()
llm.generate([list(range(5, 40))], params)
elapsed = time.perf_counter() - started
print(json.dumps({"tok_s": num_tokens / elapsed}))
"""


def measure(model: Path, setting: tuple[str, str], num_tokens: int) -> float:
    threads, adaptive = setting
    env = {**os.environ, "OMP_NUM_THREADS": threads, "NANOSERVE_ADAPTIVE_THREADS": adaptive}
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, str(model), str(num_tokens)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small-fp32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_dummy_checkpoint(Path(tmp) / "model", args.preset, 0)
        results: dict[tuple[str, str], list[float]] = {}
        for round_index in range(args.rounds):
            for load_name, load in LOADS.items():
                with running(load):
                    time.sleep(1.0)  # the load's processes reach full speed
                    for name, setting in SETTINGS.items():
                        tok_s = measure(model, setting, args.tokens)
                        results.setdefault((name, load_name), []).append(tok_s)
                        line = f"round {round_index + 1}: {name}, {load_name}: {tok_s:.1f} tok/s"
                        print(line, file=sys.stderr, flush=True)
    print(f"\nsingle-stream decode, tok/s (median of {args.rounds}), preset {args.preset}\n")
    print("| threads | " + " | ".join(LOADS) + " | 1 busy core ÷ quiet | memory ÷ quiet |")
    print("|---|" + "---|" * (len(LOADS) + 2))
    for name in SETTINGS:
        medians = [statistics.median(results[name, load]) for load in LOADS]
        quiet, busy, memory = medians
        cells = " | ".join(f"{m:.1f}" for m in medians)
        print(f"| {name} | {cells} | {quiet / busy:.1f}× slower | {quiet / memory:.1f}× slower |")


if __name__ == "__main__":
    main()
