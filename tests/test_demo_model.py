"""The embedded demo checkpoint (nanoserve/assets/demo) is complete, small and actually trained.

Produced by ``scripts/train_demo_model.py``. These checks use plain ``transformers`` so they
validate the artifact independently of nanoserve's own engine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from scripts_loader import load_script

DEMO_DIR = Path(__file__).resolve().parents[1] / "nanoserve" / "assets" / "demo"
demo_loops = load_script("demo_loops")  # the judge of greedy completions
python_looks = demo_loops.python_looks
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "README.md",
)
MAX_BYTES = 25 * 1024 * 1024

# Not stdlib code verbatim: a typical snippet the model has never seen.
SNIPPET = '''\
import os


def read_lines(path):
    """Return the lines of a text file without trailing newlines."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f]


class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value
'''


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_pretrained(DEMO_DIR).float()
    m.eval()
    return m


def test_files_present_and_small():
    for name in REQUIRED_FILES:
        assert (DEMO_DIR / name).is_file(), f"missing {name}"
    total = sum(p.stat().st_size for p in DEMO_DIR.rglob("*") if p.is_file())
    assert total <= MAX_BYTES, f"demo checkpoint is {total / 1e6:.1f} MB"


def test_config_matches_tokenizer(tokenizer):
    config = json.loads((DEMO_DIR / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert config["vocab_size"] == len(tokenizer)
    gen = json.loads((DEMO_DIR / "generation_config.json").read_text())
    eos = gen["eos_token_id"]
    assert sorted(eos) == sorted(tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]))
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    # Special tokens are single ids, not split into bytes.
    for t in ("<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"):
        assert len(tokenizer(t, add_special_tokens=False)["input_ids"]) == 1, t


def test_chat_template_renders(tokenizer):
    messages = [
        {"role": "system", "content": "You complete Python code."},
        {"role": "user", "content": "def add(a, b):"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou complete Python code.<|im_end|>\n"
        "<|im_start|>user\ndef add(a, b):<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages[1:], tokenize=False)
    assert no_prompt == "<|im_start|>user\ndef add(a, b):<|im_end|>\n"
    # OpenAI-style list-of-parts content is flattened.
    parts = [{"role": "user", "content": [{"type": "text", "text": "x = 1"}]}]
    assert tokenizer.apply_chat_template(parts, tokenize=False) == (
        "<|im_start|>user\nx = 1<|im_end|>\n"
    )
    # Byte-level BPE round-trips arbitrary text (indentation, unicode) exactly.
    assert tokenizer.decode(tokenizer(SNIPPET + "é ✓\t")["input_ids"]) == SNIPPET + "é ✓\t"


def test_loss_well_below_uniform(tokenizer, model):
    ids = tokenizer(SNIPPET, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # Uniform (and randomly initialised weights) give ~8.3 nats/token with 4096 tokens; the
    # shipped checkpoint scores ~1.9 (the one before it ~2.1). 2.5 leaves room for retraining
    # on another stdlib version.
    uniform = math.log(len(tokenizer))
    assert loss < 2.5, f"mean loss {loss:.3f} nats/token (uniform would be {uniform:.2f})"


def test_the_loop_detector_catches_the_old_demo_loops():
    assert python_looks("for i in range(10):\n    if self.is_is_is_is_is_is_is_is_is_is") != []
    assert python_looks("import os\nimport os\nimport os\nimport sys\n    x = 1") != []
    looks_fine = "def f(path):\n    if not path:\n        return None\n    return path.strip()\n"
    assert python_looks(looks_fine) == []


# Greedy completions of everyday openings look like Python, with no repetition penalty: the
# model was trained against its own greedy loops (scripts/demo_loops.py never shows it these
# openings). The model card lists the completions.
@pytest.mark.slow
@pytest.mark.parametrize("opening", demo_loops.TEST_OPENINGS)
def test_greedy_completions_of_everyday_openings_look_like_python(tokenizer, model, opening):
    ids = tokenizer(opening, return_tensors="pt")["input_ids"]
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=64, do_sample=False, repetition_penalty=1.0, pad_token_id=eos[0]
        )
    text = opening + tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert python_looks(text) == [], text


def test_the_demo_generation_config_sets_no_sampling_defaults():
    gen = json.loads((DEMO_DIR / "generation_config.json").read_text())
    assert set(gen) <= {"eos_token_id", "pad_token_id", "bos_token_id", "transformers_version"}


def test_nanoserve_greedy_tokens_on_the_demo_match_transformers(tokenizer, model):
    from nanoserve import LLM, SamplingParams

    llm = LLM(dtype="float32")  # the demo model
    assert llm.get_default_sampling_params().repetition_penalty == 1.0
    params = SamplingParams(temperature=0, max_tokens=32)
    [ours] = llm.generate("for i in range(10):", params)
    ids = tokenizer("for i in range(10):", return_tensors="pt")["input_ids"]
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=eos[0])
    assert list(ours.outputs[0].token_ids) == out[0, ids.shape[1] :].tolist()
