"""CUDA-graph decode: the parts that need no GPU (buckets, buffer sizes, padding) on CPU; the
graphs themselves against eager steps, token for token, on CUDA."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import make_tiny_checkpoint

from nanoserve.common.config import EngineConfig
from nanoserve.common.sampling_params import SamplingParams
from nanoserve.common.speculative_config import SpeculativeConfig
from nanoserve.core.step_layout import StepLayout
from nanoserve.engine_setup import build_engine
from nanoserve.platforms.cuda.cuda_graphs import (
    PAD_SLOT,
    DecodeGraphBuffers,
    block_table_width,
    bucket_for,
    capture_sizes,
)

CPU = torch.device("cpu")


def decode_step(input_ids, positions, slot_mapping, seq_lens, block_tables) -> StepLayout:
    """A decode-only step's layout (one token per request)."""
    return StepLayout(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_lens=[1] * len(input_ids),
        seq_lens=seq_lens,
        block_tables=block_tables,
        sample_rows=list(range(len(input_ids))),
    )


def test_capture_sizes_are_powers_of_two_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    sizes = capture_sizes(48)
    buckets = [bucket_for(n, sizes) for n in (1, 2, 3, 5, 16, 17, 33, 48)]
    assert buckets == [1, 2, 4, 8, 16, 32, 48, 48]
    assert bucket_for(49, sizes) is None  # more requests than max_num_seqs: run eagerly


def test_block_tables_hold_a_request_of_exactly_max_model_len():
    assert block_table_width(2048, 16) == 128
    assert block_table_width(2049, 16) == 129
    assert block_table_width(1, 16) == 1


def test_fill_copies_the_batch_and_pads_to_the_bucket():
    buffers = DecodeGraphBuffers(max_batch=8, table_width=4, device=CPU)
    inputs = decode_step(
        input_ids=[11, 12, 13],
        positions=[5, 63, 0],
        slot_mapping=[37, 251, 16],
        seq_lens=[6, 64, 1],
        block_tables=[[2, 7], [9, 3, 15, 4], [1]],  # the second is as wide as a table gets
    )
    buffers.fill(inputs, bucket=4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 63, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [37, 251, 16, PAD_SLOT]  # the pad writes nothing
    assert buffers.seq_lens[:4].tolist() == [6, 64, 1, 1]  # the pad attends over one token
    tables = buffers.block_tables[:4].tolist()
    assert tables == [[2, 7, 0, 0], [9, 3, 15, 4], [1, 0, 0, 0], [0, 0, 0, 0]]
    meta = buffers.metadata(4)
    assert meta.is_decode_only and meta.query_lens_list == [1] * 4
    assert meta.block_tables.shape == (4, 4) and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()  # views, not copies


def test_a_smaller_batch_after_a_larger_one_leaves_no_stale_rows():
    buffers = DecodeGraphBuffers(max_batch=4, table_width=2, device=CPU)
    big = decode_step([1, 2, 3, 4], [9, 9, 9, 9], [1, 2, 3, 4], [10, 10, 10, 10], [[5, 6]] * 4)
    buffers.fill(big, bucket=4)
    buffers.fill(decode_step([7], [3], [40], [4], [[2]]), bucket=2)
    assert buffers.slot_mapping[:2].tolist() == [40, PAD_SLOT]
    assert buffers.block_tables[:2].tolist() == [[2, 0], [0, 0]]


def test_a_block_table_wider_than_the_graphs_is_an_error():
    buffers = DecodeGraphBuffers(max_batch=2, table_width=2, device=CPU)
    with pytest.raises(ValueError, match="wider than the graphs' 2"):
        buffers.fill(decode_step([1], [40], [40], [41], [[1, 2, 3]]), bucket=1)


def test_cpu_engines_capture_no_graphs(tmp_path):
    engine = build_engine(
        EngineConfig(model=str(make_tiny_checkpoint(tmp_path)), device="cpu", max_model_len=64)
    )
    names = [r.name for r in engine.runner.step_runners]
    runners = ["cpu-fused-decode", "eager"]  # decode steps fused where the kernels are built
    plain = [runners, ["eager"], ["adaptive-threads(" + ", ".join(runners) + ")"]]
    assert names in [*plain, ["adaptive-threads(eager)"]]  # one thread or several
    assert engine.kv_cache.backend.name == "cpu"


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype", "calculate_kv_scales"),
    [
        ("float32", "auto", False),
        ("bfloat16", "auto", False),
        ("bfloat16", "fp8", False),
        # Scales measured on the first prompt step, after the graphs were captured: the graphs
        # read the scale tensors, updated in place.
        ("bfloat16", "fp8", True),
        ("bfloat16", "fp8_e5m2", False),
    ],
)
def test_cuda_graphs_give_the_eager_steps_tokens(
    tmp_path, dtype, kv_cache_dtype, calculate_kv_scales
):
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    prompts = [[1 + i] * (3 + 11 * i) for i in range(7)]  # 7 requests: bucket 8, one pad row
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)

    def run(enforce_eager: bool) -> list[list[int]]:
        engine = build_engine(
            EngineConfig(
                model=str(checkpoint),
                device="cuda",
                dtype=dtype,
                max_model_len=256,
                max_num_seqs=16,
                gpu_memory_utilization=0.3,
                enforce_eager=enforce_eager,
                kv_cache_dtype=kv_cache_dtype,
                calculate_kv_scales=calculate_kv_scales,
            )
        )
        names = [r.name for r in engine.runner.step_runners]
        assert names == (["eager"] if enforce_eager else ["cuda-graphs", "eager"])
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
        return [tokens[str(i)] for i in range(len(prompts))]

    assert run(enforce_eager=False) == run(enforce_eager=True)


@pytest.mark.gpu
def test_verify_steps_replay_the_decode_graphs_and_keep_greedy_tokens(tmp_path):
    """A verify step (k + 1 single-query rows per request) fits a decode bucket: drafts are
    verified by graph replays, and greedy output equals the plain eager engine's."""
    checkpoint = make_tiny_checkpoint(tmp_path, "qwen3")
    prompts = [[5, 6, 7] * 6, [9] * 12, [3, 4] * 9]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    )

    def run(enforce_eager: bool, speculative_config) -> tuple[list[list[int]], int]:
        engine = build_engine(
            EngineConfig(
                model=str(checkpoint),
                device="cuda",
                dtype="float32",
                max_model_len=256,
                max_num_seqs=16,
                gpu_memory_utilization=0.3,
                enforce_eager=enforce_eager,
                speculative_config=speculative_config,
            )
        )
        graphs = [r for r in engine.runner.step_runners if r.name == "cuda-graphs"]
        replays = 0
        if graphs:
            original = graphs[0].run

            def counted(layout):
                nonlocal replays
                replays += any(layout.draft_token_ids)
                return original(layout)

            graphs[0].run = counted  # type: ignore[method-assign]
        tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
        while engine.has_unfinished_requests():
            for delta in engine.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
        return [tokens[str(i)] for i in range(len(prompts))], replays

    speculative, num_verify_replays = run(False, spec)
    assert speculative == run(True, None)[0]
    assert num_verify_replays > 0
