"""How many prompt tokens each keystroke runs again, in-process: the prefix cache's reuse.

An editor types `--typed-chars` characters of a Python file after `--context-chars` already in
the buffer, one completion of `--max-tokens` greedy tokens per keystroke (none dropped), as the
`autocomplete` workload's requests without its timing. For each keystroke this counts the prompt
tokens the engine ran (`prompt - cached`) against the fewest it could: the tokens after the
longest prefix the prompt shares with the previous one (at least 1: the last token must run).
A count, not a time: the same on every machine.

    python -m benchmarks.keystroke_reuse --model ~/.cache/nanoserve/bench-models/qwen3-0.6b
"""

from __future__ import annotations

import argparse
import statistics

from nanoserve.bench.workloads import default_autocomplete_source
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.llm import LLM


def shared_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context-chars", type=int, default=1500)
    parser.add_argument("--typed-chars", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=10)
    args = parser.parse_args()
    text = default_autocomplete_source().read_text(encoding="utf-8")
    llm = LLM(args.model, max_model_len=4096)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    previous: list[int] = []
    ran, fewest = [], []
    for k in range(args.typed_chars):
        [output] = llm.generate([text[: args.context_chars + k + 1]], params)
        prompt = output.prompt_token_ids
        if previous:  # the first request finds nothing: it reads the whole buffer
            ran.append(len(prompt) - output.num_cached_tokens)
            fewest.append(max(1, len(prompt) - shared_prefix_len(previous, prompt)))
        previous = prompt
    print(f"{len(ran)} keystrokes after the first, block size {llm.engine.scheduler.kv.block_size}")
    for name, counts in (("ran", ran), ("fewest possible", fewest)):
        print(
            f"prompt tokens per keystroke, {name}: mean {statistics.mean(counts):.2f}, "
            f"median {statistics.median(counts)}, max {max(counts)}, total {sum(counts)}"
        )
    extra = sum(r > f for r, f in zip(ran, fewest, strict=True))
    print(f"keystrokes that ran more than the fewest possible: {extra} of {len(ran)}")


if __name__ == "__main__":
    main()
