"""lm-eval's real `local-completions` model against `nanoserve serve`, beside lm-eval's `hf`
model (transformers in-process) on the same checkpoint and tasks: the per-example
loglikelihoods must agree.

lm-eval is not a dependency of nanoserve; give the Python that has it (it must not replace
torch), e.g. a venv that sees this one's packages:

    python -m venv --system-site-packages /tmp/lmeval-venv
    /tmp/lmeval-venv/bin/pip install "lm_eval[api]" accelerate
    python -m benchmarks.lm_eval_check --lm-eval-python /tmp/lmeval-venv/bin/python

Three local tasks are written to the output directory (no hub download), built from the
standard library's source with a fixed seed: `nanoserve_python_mc` (multiple choice: which
second half ends a line of code; lm-eval's loglikelihood requests), `nanoserve_python_next`
(loglikelihood of the next line: perplexity and greedy accuracy) and `nanoserve_python_source`
(loglikelihood_rolling over source files cut into windows: word and byte perplexity).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

DEMO = Path(__file__).resolve().parents[1] / "nanoserve" / "assets" / "demo"
SOURCES = ("textwrap.py", "shlex.py", "fnmatch.py", "colorsys.py")
TASKS = ("nanoserve_python_mc", "nanoserve_python_next", "nanoserve_python_source")
# lm-eval's API model keeps max_length - 1 tokens and rolls windows of one less again; its hf
# model rolls windows of max_length: these give both the same 128-token windows.
API_MAX_LENGTH, HF_MAX_LENGTH = 130, 128


def source_lines() -> list[list[str]]:
    """The lines of a few standard-library modules, one list per file."""
    stdlib = Path(textwrap.__file__).parent
    return [(stdlib / name).read_text().splitlines() for name in SOURCES]


def write_tasks(directory: Path, num_docs: int, seed: int) -> None:
    """Three JSONL data sets and their task YAMLs."""
    rng = random.Random(seed)
    files = source_lines()
    # Lines with code to cut in two, after a few lines that are not all blank (lm-eval needs a
    # context that is more than whitespace).
    candidates = [
        (lines, i)
        for lines in files
        for i, line in enumerate(lines)
        if len(line.strip()) >= 30 and "".join(lines[max(0, i - 3) : i]).strip()
    ]
    picked = rng.sample(candidates, num_docs * 4)
    mc, nxt = [], []
    for k in range(num_docs):
        lines, i = picked[k]
        first, second = _halves(lines[i])
        context = "\n".join([*lines[max(0, i - 3) : i], first])
        others = [_halves(other[j])[1] for other, j in picked[num_docs + 3 * k :][:3]]
        choices = [second, *others]
        rng.shuffle(choices)
        mc.append({"context": context, "choices": choices, "answer": choices.index(second)})
        nxt.append({"context": "\n".join(lines[max(0, i - 3) : i]) + "\n", "target": lines[i]})
    source = []
    for lines in files:
        for start in range(0, min(len(lines), 120), 40):
            source.append({"text": "\n".join(lines[start : start + 40])})
    for name, docs in (("mc", mc), ("next", nxt), ("source", source)):
        with open(directory / f"python_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(doc) + "\n" for doc in docs)
    for task, text in _task_yamls(directory).items():
        (directory / f"{task}.yaml").write_text(text)


def _halves(line: str) -> tuple[str, str]:
    """A line of code cut in the middle of its text (not of its indentation)."""
    indent = len(line) - len(line.lstrip())
    cut = indent + (len(line) - indent) // 2
    return line[:cut], line[cut:]


def _task_yamls(directory: Path) -> dict[str, str]:
    """lm-eval task configs over the local JSONL files (`dataset_path: json`)."""

    def header(task: str, data: str, output_type: str) -> str:
        return (
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {directory / data}\ntest_split: test\noutput_type: {output_type}\n"
            "target_delimiter: ''\n"  # code: the continuation follows the context directly
        )

    return {
        "nanoserve_python_mc": header("nanoserve_python_mc", "python_mc.jsonl", "multiple_choice")
        + "doc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "nanoserve_python_next": header(
            "nanoserve_python_next", "python_next.jsonl", "loglikelihood"
        )
        + "doc_to_text: '{{context}}'\ndoc_to_target: '{{target}}'\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n",
        "nanoserve_python_source": header(
            "nanoserve_python_source", "python_source.jsonl", "loglikelihood_rolling"
        )
        + "doc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
    }


def start_server(model: Path, port: int, log_path: Path) -> subprocess.Popen:
    """`nanoserve serve` in float32 (the same arithmetic as the transformers side)."""
    argv = [
        sys.executable,
        "-m",
        "nanoserve.cli.main",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--served-model-name",
        "demo",
    ]
    process = subprocess.Popen(argv, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited: see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise TimeoutError(f"the server did not become healthy: see {log_path}")


def run_lm_eval(python: str, model_args: list[str], tasks_dir: Path, output: Path) -> float:
    """One `lm-eval run`; returns its wall time in seconds."""
    argv = [
        python,
        "-m",
        "lm_eval",
        "run",
        *model_args,
        "--tasks",
        *TASKS,
        "--include_path",
        str(tasks_dir),
        "--log_samples",
        "--output_path",
        str(output),
        "--device",
        "cpu",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    print("$", " ".join(argv), flush=True)
    started = time.perf_counter()
    subprocess.run(argv, check=True, env=env)
    return time.perf_counter() - started


def read_run(output: Path) -> tuple[dict, dict[tuple[str, int], list[float]]]:
    """lm-eval's results (metrics per task) and every sample's loglikelihoods by (task, doc)."""
    [results_file] = output.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    samples = {}
    for task in TASKS:
        [samples_file] = output.rglob(f"samples_{task}_*.jsonl")
        for line in samples_file.read_text().splitlines():
            sample = json.loads(line)
            values = [float(_first(r)) for r in sample["resps"]]
            samples[(task, sample["doc_id"])] = values
    return results, samples


def _first(response):
    """A response is [loglikelihood, is_greedy] or [loglikelihood], possibly nested once."""
    while isinstance(response, list):
        response = response[0]
    return response


def compare(ours: dict, reference: dict) -> list[str]:
    """A markdown table: per task, requests, the largest loglikelihood gap, metrics side by side."""
    lines = [
        "| task | examples | loglikelihoods | max abs diff | metric | nanoserve | transformers |",
        "|---|---|---|---|---|---|---|",
    ]
    our_results, our_samples = ours
    ref_results, ref_samples = reference
    assert our_samples.keys() == ref_samples.keys(), "the two runs scored different examples"
    for task in TASKS:
        keys = [k for k in our_samples if k[0] == task]
        pairs = [(a, b) for k in keys for a, b in zip(our_samples[k], ref_samples[k], strict=True)]
        gap = max(abs(a - b) for a, b in pairs)
        for name, value in sorted(our_results[task].items()):
            if "," not in name or name.startswith("alias") or "stderr" in name:
                continue
            lines.append(
                f"| {task} | {len(keys)} | {len(pairs)} | {gap:.2e} | {name.split(',')[0]} | "
                f"{value:.6g} | {ref_results[task][name]:.6g} |"
            )
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm-eval-python", required=True, help="a Python with lm_eval")
    parser.add_argument("--model", type=Path, default=DEMO, help="checkpoint directory")
    parser.add_argument("--num-docs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=4, help="prompts per request")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args()
    output = args.output_dir or Path("benchmarks/results") / time.strftime("%Y-%m-%d-lm-eval")
    tasks_dir = output / "tasks"
    tasks_dir.mkdir(parents=True, exist_ok=True)
    write_tasks(tasks_dir.resolve(), args.num_docs, args.seed)
    model = args.model.resolve()
    batch = ["--batch_size", str(args.batch_size)]
    load_before = os.getloadavg()[0]
    port = free_port()
    server = start_server(model, port, output / "server.log")
    try:
        served = run_lm_eval(
            args.lm_eval_python,
            [
                "--model",
                "local-completions",
                "--model_args",
                f"model=demo,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer={model},"
                f"tokenizer_backend=huggingface,num_concurrent=2,max_retries=1,"
                f"max_length={API_MAX_LENGTH}",
                *batch,
            ],
            tasks_dir,
            output / "nanoserve",
        )
    finally:
        server.terminate()
        server.wait(timeout=60)
    in_process = run_lm_eval(
        args.lm_eval_python,
        [
            "--model",
            "hf",
            "--model_args",
            # logits_cache=False: with its cache of logits shared by requests of one context,
            # lm-eval's hf model gave 22 of the 160 multiple-choice continuations values far
            # (up to 159 nats) from transformers called directly on the same token ids.
            f"pretrained={model},dtype=float32,max_length={HF_MAX_LENGTH},logits_cache=False",
            "--batch_size",
            "1",
        ],
        tasks_dir,
        output / "transformers",
    )
    table = compare(read_run(output / "nanoserve"), read_run(output / "transformers"))
    summary = [
        f"{time.strftime('%Y-%m-%d')}, {platform.platform()}, {os.cpu_count()} CPUs, "
        f"load average {load_before:.2f} at start; lm-eval wall time: nanoserve "
        f"{served:.0f} s, transformers {in_process:.0f} s",
        "",
        *table,
    ]
    (output / "summary.md").write_text("\n".join(summary) + "\n")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
