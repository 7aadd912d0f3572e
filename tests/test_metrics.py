"""The per-request histograms vLLM's dashboards read, from one finished request's timestamps."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineMetrics
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput


def samples(metrics: EngineMetrics) -> dict[str, float]:
    text = metrics.exposition().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if not s.name.endswith("_bucket") and not s.name.endswith("_created")}


def finished(prompt: int, generated: int, times: tuple, max_tokens: int) -> RequestOutput:
    return RequestOutput("r1", None, list(range(prompt)), [CompletionOutput(0, "x", list(range(generated)), "stop")],
                         finished=True, metrics=RequestMetrics(*times, max_tokens=max_tokens))


def test_one_request_feeds_the_per_request_histograms():
    m = EngineMetrics("m")
    m.on_output(finished(prompt=12, generated=5, times=(100.0, 100.5, 101.5, 103.5), max_tokens=64))
    s = samples(m)
    assert s["vllm:request_prompt_tokens_sum"] == 12 and s["vllm:request_prompt_tokens_count"] == 1
    assert s["vllm:request_generation_tokens_sum"] == 5
    assert s["vllm:request_max_num_generation_tokens_sum"] == 64
    assert s["vllm:request_queue_time_seconds_sum"] == 0.5
    assert s["vllm:request_prefill_time_seconds_sum"] == 1.0
    assert s["vllm:request_decode_time_seconds_sum"] == 2.0
    assert s["vllm:request_inference_time_seconds_sum"] == 3.0
    assert s["vllm:request_time_per_output_token_seconds_sum"] == 0.5  # 2 s over the 4 tokens after the first
    assert s["vllm:time_per_output_token_seconds_sum"] == 0.5
    assert s["vllm:e2e_request_latency_seconds_sum"] == 3.5


def test_a_request_cut_before_its_first_token_has_no_decode_time():
    m = EngineMetrics("m")
    m.on_output(finished(prompt=3, generated=0, times=(10.0, 10.2, None, 11.0), max_tokens=8))
    s = samples(m)
    assert s["vllm:request_decode_time_seconds_count"] == 0 and s["vllm:request_prefill_time_seconds_count"] == 0
    assert abs(s["vllm:request_inference_time_seconds_sum"] - 0.8) < 1e-9
    assert s["vllm:request_generation_tokens_sum"] == 0
