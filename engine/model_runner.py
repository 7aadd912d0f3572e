"""SchedulerOutput -> one flat batch -> model -> logits of the sampling rows -> sampler.

The batch has no padding through the linear layers: every scheduled token of every request is one
row. One-token sequences (decodes) come first so paged attention can treat them as one batch.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.attention import AttentionMetadata, PrefillSeq, use_metadata
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.sampler import Sampler


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler(seed, device)
        layers = model.attention_layers()
        a = layers[0]
        shape = (len(layers), num_blocks, block_size, a.num_kv_heads, a.head_dim)
        # Zeroed, not empty: padded decode rows read block 0, and garbage there could be NaN.
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        for i, layer in enumerate(layers):
            layer.k_cache, layer.v_cache = self.k_cache[i], self.v_cache[i]

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
        layers = model.attention_layers()
        a = layers[0]
        return 2 * len(layers) * block_size * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        logits, samplers = self.forward(sched)
        if not samplers:
            return ModelRunnerOutput({})
        requests = [s.request for s in samplers]
        try:
            return ModelRunnerOutput({r.request_id: t for r, t in zip(requests, self.sampler(logits, requests))})
        except Exception:  # noqa: BLE001 - a fault is the request's own: find whose, row by row
            return self._sample_rows(logits, requests)

    def _sample_rows(self, logits: torch.Tensor, requests: list) -> ModelRunnerOutput:
        """Sample each row alone: the rows that fail fail their request, the others go on."""
        out = ModelRunnerOutput({})
        for i, req in enumerate(requests):
            try:
                out.sampled[req.request_id] = self.sampler(logits[i:i + 1], [req])[0]
            except Exception as e:  # noqa: BLE001
                out.failed[req.request_id] = f"sampling failed: {type(e).__name__}: {e}"
        return out

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[ScheduledRequest]]:
        """Run the model on one step's batch; logits [n, V] for the n requests that sample."""
        items = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1)  # decodes first (stable)
        input_ids, positions, meta, logits_rows, samplers = self._prepare(items)
        with use_metadata(meta):
            hidden = self.model(input_ids, positions)
        if not samplers:
            return None, []
        return self.model.compute_logits(hidden[logits_rows]), samplers

    @torch.inference_mode()
    def logits_for_all(self, item: ScheduledRequest) -> torch.Tensor:
        """Logits at every position of one scheduled chunk (scoring, not generation)."""
        input_ids, positions, meta, _, _ = self._prepare([item])
        with use_metadata(meta):
            hidden = self.model(input_ids, positions)
        return self.model.compute_logits(hidden)

    def _prepare(self, items: list[ScheduledRequest]):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        samplers: list[ScheduledRequest] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for s in items:
            req, n, blocks = s.request, s.num_tokens, s.block_ids
            start = req.num_computed_tokens
            row = len(ids)
            ids.extend(req.all_token_ids[start:start + n])
            for p in range(start, start + n):
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            ctx_len = start + n
            if n == 1:
                decode_tables.append(blocks[:-(-ctx_len // bs)])
                decode_lens.append(ctx_len)
            else:
                used = torch.tensor(blocks[:-(-ctx_len // bs)], dtype=torch.long, device=self.device)
                prefills.append(PrefillSeq(row, n, ctx_len, used))
            if s.samples:
                logits_rows.append(row + n - 1)
                samplers.append(s)
        dev = self.device
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), len(decode_tables),
                                 prefills=prefills)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long, device=dev)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            meta.decode_block_tables, meta.decode_seq_lens = table, lens
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, torch.tensor(logits_rows, dtype=torch.long, device=dev), samplers)
