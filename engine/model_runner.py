"""SchedulerOutput -> one flat batch -> model -> logits of the sampling rows -> sampler.

The batch has no padding through the linear layers: every scheduled token of every request is one
row. One-token sequences (decodes) come first, then prompt chunks attended row by row, so paged
attention can treat all those rows as one batch of one-token sequences.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from engine import cpu_kernels
from engine.attention import AttentionMetadata, PagedAttention, PrefillSeq, use_metadata
from engine.cascade import find_shared_prefix, shared_tokens_needed
from engine.kv_layout import int8_block_bytes, kv_cache_shapes
from engine.linear import Linear
from engine.outputs import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from engine.sampler import Sampler

# Few rows through a small model's layers: torch's ops on one thread. Waking its sleeping threads
# costs more than they save on matrices this small (measured here, 2 cores, SmolLM2-135M, decode steps:
# batch 1 23 -> 19.5 ms, batch 8 50 -> 43 ms; on 2048x5632 two threads win already at one row). Our
# kernels, which carry the weight of such steps, keep their own warm threads (cpu_kernels.set_threads):
# with them steps of 8-32 rows took the same or 1-3% less at 32 than at 16 or 8. The LM head, the
# largest matrix, always gets every thread.
ONE_THREAD_ROWS = 32
ONE_THREAD_MAX_WEIGHTS = 4 * 2**20  # a model qualifies when its largest Linear has fewer weights
# Decode attention is split over threads from this many context tokens in the step, whatever the
# rest does (measured: 8 sequences of ~600 tokens, 220 us a layer on one thread; one of 100, 18 us on
# one and 35 on two).
PARALLEL_ATTENTION_TOKENS = 2048
# Prompt chunks are attended row by row by the decode kernel (each row a one-token sequence over its
# own prefix) rather than by SDPA with a mask: each row then computes exactly what it would as a
# decode, whatever the chunking, the prefix cache or the drafts beside it. In bf16 on AVX-512 BF16 at
# any length (a fresh 4000-token prompt 2.3x faster on a Zen 5: docs/benchmarks.md, "Long system
# prompts"); in fp32 (rows lost there at 4000 tokens), or where a layer's attention leaves the C kernel
# (a softcap: the torch path gathers each row's context), up to this many tokens of context.
ROW_PREFILL_CONTEXT = 1024


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, seed: int, logprobs_mode: str = "raw_logprobs", threads: int = 1,
                 kv_cache_dtype: str = "auto", cascade: bool = False) -> None:
        """cascade: rows sharing a long prefix attend to it once for all (engine/cascade.py), whose rounding
        differs from the per-sequence kernel's: the engine's batch_invariant off."""
        self.model = model
        self.cascade = cascade
        self.threads = threads  # torch's and our kernels', set at each step: two engines may coexist
        self.logprobs_mode = logprobs_mode
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler(seed, device)
        largest = max((m.in_features * m.out_features for name, m in model.named_modules()
                       if isinstance(m, Linear) and name != "lm_head"), default=0)  # the head runs on all threads
        self.small_model = device.type == "cpu" and largest < ONE_THREAD_MAX_WEIGHTS
        layers = model.attention_layers()
        a = layers[0]
        self.kv_cache_dtype, self.head_dim = kv_cache_dtype, a.head_dim
        if kv_cache_dtype == "int8":
            k_shape = v_shape = (num_blocks, int8_block_bytes(block_size, a.num_kv_heads, a.head_dim))
            pool_dtype = torch.uint8
        else:
            k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, a.num_kv_heads, a.head_dim)
            pool_dtype = dtype
        # Zeroed, not empty: padded decode rows read block 0, and garbage there could be NaN.
        self.k_cache = torch.zeros(len(layers), *k_shape, dtype=pool_dtype, device=device)
        self.v_cache = torch.zeros(len(layers), *v_shape, dtype=pool_dtype, device=device)
        for i, layer in enumerate(layers):
            layer.bind_cache(self.k_cache[i], self.v_cache[i], int8=kv_cache_dtype == "int8")
        self.row_context = self._row_context(layers)
        if hasattr(model, "fuse_layers"):
            model.fuse_layers()  # pointers into the weights and the pools just bound

    def copy_block(self, source: int, target: int) -> None:
        """Copy one block's K/V in every layer (copy on write, for a forked sequence)."""
        self.k_cache[:, target].copy_(self.k_cache[:, source])
        self.v_cache[:, target].copy_(self.v_cache[:, source])

    def read_block(self, block_id: int) -> torch.Tensor:
        """One block's K and V on the CPU, [2, layers, elements] (K and V differ in layout: each flattened)."""
        return torch.stack((self.k_cache[:, block_id].flatten(1), self.v_cache[:, block_id].flatten(1))).cpu()

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        """The inverse of read_block (flatten: a view of the one block)."""
        self.k_cache[:, block_id].flatten(1).copy_(kv[0])
        self.v_cache[:, block_id].flatten(1).copy_(kv[1])

    @property
    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    @staticmethod
    def bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        layers = model.attention_layers()
        a = layers[0]
        if kv_cache_dtype == "int8":
            return 2 * len(layers) * int8_block_bytes(block_size, a.num_kv_heads, a.head_dim)
        return 2 * len(layers) * block_size * a.num_kv_heads * a.head_dim * torch.finfo(dtype).bits // 8

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        logits, samplers, prompt_scores = self.forward(sched)
        out = ModelRunnerOutput({}, prompt_logprobs=prompt_scores)
        if any(s.draft_token_ids for s in samplers):
            logits, samplers = self._verify_drafts(logits, samplers, out)
        if not samplers:
            return out
        requests = [s.request for s in samplers]
        scored_logits = logits
        try:
            out.sampled.update({r.request_id: [t] for r, t in zip(requests, self.sampler(logits, requests))})
            if self.logprobs_mode == "processed_logprobs":
                scored_logits = self.sampler.processed
        except Exception:  # noqa: BLE001 - a fault is the request's own: find whose, row by row
            self._sample_rows(logits, requests, out)
        asking = [(i, r) for i, r in enumerate(requests) if r.params.logprobs is not None and r.request_id in out.sampled]
        if asking:  # raw (the model's, vLLM's default) or processed (what was sampled from): logprobs_mode
            rows = torch.tensor([i for i, _ in asking], device=logits.device)
            chosen = [out.sampled[r.request_id][0] for _, r in asking]
            scored = score_tokens(scored_logits[rows], chosen, max(r.params.logprobs for _, r in asking))
            for (_, r), token, entry in zip(asking, chosen, scored):
                out.logprobs[r.request_id] = trim(entry, token, r.params.logprobs)
        return out

    def _verify_drafts(self, logits: torch.Tensor, samplers: list[ScheduledRequest], out: ModelRunnerOutput):
        """Settle the requests that drafted (1 + drafts rows each); returns the other rows and requests."""
        plain_rows, plain, spec_rows, spec = [], [], [], []
        row = 0
        for s in samplers:
            n = 1 + len(s.draft_token_ids)
            (spec_rows if s.draft_token_ids else plain_rows).extend(range(row, row + n))
            (spec if s.draft_token_ids else plain).append(s)
            row += n
        spec_logits = logits[torch.tensor(spec_rows, device=logits.device)]
        try:
            kept = self.sampler.verify(spec_logits, [s.request for s in spec], [s.draft_token_ids for s in spec])
            out.sampled.update({s.request.request_id: k for s, k in zip(spec, kept)})
        except Exception as e:  # noqa: BLE001 - their own fault: the rest of the batch goes on
            out.failed.update({s.request.request_id: f"sampling failed: {type(e).__name__}: {e}" for s in spec})
        return logits[torch.tensor(plain_rows, dtype=torch.long, device=logits.device)], plain

    def _sample_rows(self, logits: torch.Tensor, requests: list, out: ModelRunnerOutput) -> None:
        """Sample each row alone: the rows that fail fail their request, the others go on."""
        for i, req in enumerate(requests):
            try:
                out.sampled[req.request_id] = self.sampler(logits[i:i + 1], [req])
            except Exception as e:  # noqa: BLE001
                out.failed[req.request_id] = f"sampling failed: {type(e).__name__}: {e}"

    @torch.inference_mode()
    def forward(self, sched: SchedulerOutput):
        """Run the model on one step's batch: logits for the requests that sample (a row each, 1 + drafts
        rows for one that drafted), those requests, and the prompt log-probabilities of this chunk for
        requests that ask for them."""
        cpu_kernels.set_threads(self.threads)  # before _prepare, which reads it
        items = sorted(sched.scheduled, key=self._row_order)  # rows attended one by one first (stable)
        input_ids, positions, meta, logits_rows, samplers = self._prepare(items)
        with use_metadata(meta), self._threads_for(len(input_ids)):
            hidden = self.model(input_ids, positions)
        prompt_scores = self._prompt_logprobs(items, hidden)
        if not samplers:
            return None, [], prompt_scores
        return self.model.compute_logits(hidden[logits_rows]), samplers, prompt_scores

    def _row_order(self, s: ScheduledRequest) -> int:
        """0 for a decode, 1 for a prompt chunk attended row by row (ROW_PREFILL_CONTEXT), 2 else."""
        if s.num_tokens == 1:
            return 0
        return 1 if self._by_rows(s.request.num_computed_tokens + s.num_tokens) else 2

    def _by_rows(self, ctx_len: int) -> bool:
        return ctx_len <= self.row_context

    def _row_context(self, layers: list[PagedAttention]) -> float:
        """The longest context at which a prompt chunk is attended row by row (ROW_PREFILL_CONTEXT)."""
        if self.device.type != "cpu" or self.dtype not in (torch.float32, torch.bfloat16) \
                or not cpu_kernels.available():
            return 0
        if self.dtype == torch.bfloat16 and cpu_kernels.has("bf16_attention") and \
                all(layer.kernel_serves(self.dtype) for layer in layers):
            return math.inf
        return ROW_PREFILL_CONTEXT

    @contextlib.contextmanager
    def _threads_for(self, rows: int):
        """This runner's threads for the step (torch's and our kernels' settings are process-wide, and
        another engine may have run last); one torch thread for a few rows through a small model's
        layers (ONE_THREAD_ROWS)."""
        one = self.small_model and rows <= ONE_THREAD_ROWS and self.threads > 1
        _torch_threads(1 if one else self.threads)
        try:
            yield
        finally:
            if one:
                _torch_threads(self.threads)

    def _prompt_logprobs(self, items: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, tuple]:
        """For each prompt chunk of a request with prompt_logprobs: position p scores prompt token
        p+1. Returns request_id -> (the first prompt position scored, one entry per position)."""
        scores, row = {}, 0
        for s in items:
            req, start = s.request, s.request.num_computed_tokens
            if req.params.prompt_logprobs is not None and start + 1 < req.num_prompt_tokens:
                targets = req.all_token_ids[start + 1:min(start + s.num_tokens, req.num_prompt_tokens - 1) + 1]
                logits = self.model.compute_logits(hidden[row:row + len(targets)])
                k = req.params.prompt_logprobs
                scores[req.request_id] = (start + 1, [trim(e, t, k) for e, t in
                                                      zip(score_tokens(logits, targets, k), targets)])
            row += s.num_tokens
        return scores

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
        row_tables: list[tuple[list[int], int]] = []  # rows attended one by one: (blocks, how many rows)
        row_lens: list[int] = []
        row_hashes: list[list[int]] = []  # names the content of shared blocks (attention caches it)
        prefills: list[PrefillSeq] = []
        num_decode = 0
        for s in items:
            req, n, blocks, drafts = s.request, s.num_tokens, s.block_ids, s.draft_token_ids
            start = req.num_computed_tokens
            row = len(ids)
            ids.extend(req.all_token_ids[start:start + n - len(drafts)])
            ids.extend(drafts)
            for p in range(start, start + n):
                pos.append(p)
                slots.append(blocks[p // bs] * bs + p % bs)
            ctx_len = start + n
            num_decode += n == 1
            if n == 1 or self._by_rows(ctx_len):
                row_tables.append((blocks[:-(-ctx_len // bs)], n))
                row_lens.extend(range(start + 1, ctx_len + 1))
                row_hashes.extend([req.block_hashes] * n)
            else:
                used = torch.tensor(blocks[:-(-ctx_len // bs)], dtype=torch.long, device=self.device)
                prefills.append(PrefillSeq(row, n, ctx_len, used))
            if s.samples:  # the last row, and with drafts every row that verifies one
                logits_rows.extend(range(row + n - 1 - len(drafts), row + n))
                samplers.append(s)
        dev = self.device
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=dev), num_decode, prefills=prefills)
        if row_tables:
            width = max(len(t) for t, _ in row_tables)
            table = torch.tensor([t + [0] * (width - len(t)) for t, _ in row_tables], dtype=torch.long, device=dev)
            if len(row_tables) < len(row_lens):  # a prompt chunk's (or drafts') rows share its table
                table = table.repeat_interleave(torch.tensor([n for _, n in row_tables], device=dev), dim=0)
            lens = torch.tensor(row_lens, dtype=torch.long, device=dev)
            meta.row_block_tables, meta.row_seq_lens = table, lens
            if dev.type == "cpu":
                meta.kernel_threads = cpu_kernels.threads() if sum(row_lens) >= PARALLEL_ATTENTION_TOKENS else 1
                if self.cascade:
                    meta.shared = find_shared_prefix(table, lens, bs, row_hashes,
                                                     shared_tokens_needed(self.dtype, self.head_dim))
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev),
                meta, torch.tensor(logits_rows, dtype=torch.long, device=dev), samplers)


def score_tokens(logits: torch.Tensor, chosen: list[int], k: int) -> list[dict[int, tuple[float, int]]]:
    """Per row: the chosen token's (log-probability, rank) and the top-k tokens' (rank 1 is the best)."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, torch.tensor(chosen, device=logits.device).unsqueeze(1))
    ranks = (logprobs > picked).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    rows = []
    for i, token in enumerate(chosen):
        entry = {token: (picked[i, 0].item(), int(ranks[i]))}
        for rank, (value, tid) in enumerate(zip(top_values[i].tolist(), top_ids[i].tolist()), 1):
            entry.setdefault(tid, (value, rank))
        rows.append(entry)
    return rows


def trim(entry: dict[int, tuple[float, int]], chosen: int, k: int) -> dict[int, tuple[float, int]]:
    """The chosen token and the top-k of this request (a batch may have scored more)."""
    return {t: v for t, v in entry.items() if t == chosen or v[1] <= k}


def _torch_threads(n: int) -> None:
    """torch.set_num_threads, only when it changes something (it is called on every step)."""
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
