"""CUDA graphs for decode steps: launch a whole forward pass with one call.

A decode step of a small batch is a few hundred small kernels; launched one by one from Python
the GPU waits on the CPU. At start-up the runner records (captures) the model's forward pass for
a few batch sizes ("buckets": 1, 2, 4, 8, ... up to `max_num_seqs`) over persistent input
buffers. A decode step of n requests then copies its inputs into the buffers, pads the batch to
the smallest bucket ≥ n, and replays that bucket's graph. Padding rows write no KV (slot -1)
and attend over one token of block 0; their outputs are dropped.

`CudaGraphRunner` is a step runner: it takes decode-only steps that fit a bucket, and only with
the Triton attention backend (whose decode grid depends on the batch size alone); prefill and
mixed steps go to the eager runner. `--enforce-eager` turns graphs off.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from nanoserve.core.attention.metadata import AttentionMetadata
from nanoserve.core.model_runner import StepRunner
from nanoserve.core.models.base import CausalLM
from nanoserve.core.step_layout import StepLayout

logger = logging.getLogger("nanoserve.cuda_graphs")

PAD_SLOT = -1  # the KV write skips these rows


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: powers of two below `max_num_seqs`, and `max_num_seqs` itself."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


def bucket_for(num_requests: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_requests`, or None when none does."""
    return next((size for size in sizes if size >= num_requests), None)


def block_table_width(max_model_len: int, block_size: int) -> int:
    """Blocks a request of `max_model_len` tokens needs: the graph's block-table width."""
    return -(-max_model_len // block_size)


class DecodeGraphBuffers:
    """The persistent tensors every captured graph reads; a step's inputs are copied in."""

    def __init__(self, max_batch: int, table_width: int, device: torch.device) -> None:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        self.max_batch = max_batch
        self.table_width = table_width
        self.input_ids = longs(max_batch)  # [N]
        self.positions = longs(max_batch)  # [N]
        self.slot_mapping = longs(max_batch).fill_(PAD_SLOT)  # [N]
        self.seq_lens = longs(max_batch).fill_(1)  # [N]
        self.block_tables = longs(max_batch, table_width)  # [N, W]
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int64, device=device)

    def fill(self, inputs: StepLayout, bucket: int) -> None:
        """Copy a decode step's inputs into rows [0, n) and make rows [n, bucket) padding."""
        n = len(inputs.input_ids)
        assert n <= bucket <= self.max_batch, f"{n} requests do not fit bucket {bucket}"
        table = torch.zeros(bucket, self.table_width, dtype=torch.int64)
        for row, blocks in enumerate(inputs.block_tables):
            if len(blocks) > self.table_width:
                raise ValueError(
                    f"a block table of {len(blocks)} blocks is wider than the graphs' "
                    f"{self.table_width} (max_model_len / block_size)"
                )
            table[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
        pad = bucket - n
        rows = [
            (self.input_ids, inputs.input_ids + [0] * pad),
            (self.positions, inputs.positions + [0] * pad),
            (self.slot_mapping, inputs.slot_mapping + [PAD_SLOT] * pad),
            (self.seq_lens, inputs.seq_lens + [1] * pad),
        ]
        for buffer, values in rows:
            buffer[:bucket].copy_(torch.tensor(values, dtype=torch.int64))
        self.block_tables[:bucket].copy_(table)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The attention metadata of a `bucket`-row decode step: views of the buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            query_lens_list=[1] * bucket,
            seq_lens_list=[],  # only the reference backend reads it, and graphs run Triton's
            is_decode_only=True,
        )


class CudaGraphRunner(StepRunner):
    """Captures the model's decode forward pass per bucket and replays it."""

    name = "cuda-graphs"

    def __init__(
        self,
        model: CausalLM,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        super().__init__(model)
        self.capture_time_s = 0.0
        self.sizes = capture_sizes(max_num_seqs)
        self.buffers = DecodeGraphBuffers(
            self.sizes[-1], block_table_width(max_model_len, block_size), device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's [bucket, hidden]
        self._pool: Any = None  # the graphs' shared memory pool (an opaque handle)

    def capture(self) -> float:
        """Capture every bucket, largest first (they share one memory pool); seconds taken."""
        started = time.perf_counter()
        with torch.inference_mode():
            for bucket in reversed(self.sizes):
                self._capture_one(bucket)
        torch.cuda.synchronize()
        self.capture_time_s = time.perf_counter() - started
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            self.capture_time_s,
        )
        return self.capture_time_s

    def _capture_one(self, bucket: int) -> None:
        buffers = self.buffers
        args = (buffers.input_ids[:bucket], buffers.positions[:bucket], buffers.metadata(bucket))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up runs: kernels compiled, allocations made
            for _ in range(2):
                self.model(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self.outputs[bucket] = self.model(*args)
        self._pool = graph.pool()
        self.graphs[bucket] = graph

    def can_run(self, layout: StepLayout) -> bool:
        return layout.is_decode_only and bucket_for(len(layout.query_lens), self.sizes) is not None

    def run(self, layout: StepLayout) -> torch.Tensor:  # [S + P, hidden]
        """Replay the smallest fitting graph on this step's inputs; the output rows."""
        bucket = bucket_for(len(layout.input_ids), self.sizes)
        assert bucket is not None, "call can_run first"
        self.buffers.fill(layout, bucket)
        self.graphs[bucket].replay()
        hidden = self.outputs[bucket][: len(layout.input_ids)]  # [T, hidden]
        return hidden if layout.is_every_row_output else hidden[layout.output_rows]
