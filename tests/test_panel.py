"""The live panel's sampler on a real engine: every open panel asks it every second, and each
sample is rendered once for all of them."""
import asyncio

import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from tests.serving import wait_for
from engine.sampling_params import SamplingParams
from ui.panel import PLOTS, PanelSampler, series

pytestmark = pytest.mark.e2e


def test_open_panels_share_one_rendering_per_sample(tiny_model):
    llm = AsyncLLM(EngineConfig(model=tiny_model("llama")[0], dtype="float32", num_kv_blocks=64))
    try:
        assert llm.wait_ready(120)
        sampler = PanelSampler(llm, interval=3600)  # its thread takes a first sample, then sleeps
        sampler.render()
        wait_for(lambda: sampler.latest is not None, 30, "the first sample")
        first = sampler.render()
        assert len(first) == 3 + len(PLOTS) and "kv-map" in first[1]
        assert all(a is b for a, b in zip(first, sampler.render()))  # the second panel's tick: nothing rebuilt
        llm.reset_prefix_cache()
        assert sampler.sample()
        second = sampler.render()
        assert second[1] is not first[1] and second[3] is not first[3]  # a new sample: rendered anew
        assert len(sampler.history) == 2
    finally:
        llm.shutdown()


def test_every_frame_holds_every_series_of_its_plot():
    """A plot's legend and colours are its first frame's: a series missing from it is never drawn."""
    frame = series([], ["prefill", "decode"])
    assert sorted(frame["series"]) == ["decode", "prefill"] and (frame["value"] == 0).all()
    frame = series([{"t": 0.0, "prefill": 7}], ["prefill", "decode"])
    assert dict(zip(frame["series"], frame["value"])) == {"prefill": 7.0, "decode": 0.0}


def test_the_panel_draws_every_series_and_the_mean_step_since_the_last_sample(tiny_model):
    llm = AsyncLLM(EngineConfig(model=tiny_model("llama")[0], dtype="float32", num_kv_blocks=64))
    try:
        assert llm.wait_ready(120)
        sampler = PanelSampler(llm, interval=3600)
        frames = sampler.render()[3:]  # before or just after the first sample
        names = [set(frame["series"]) for frame in frames]
        assert names == [set(n) - {"GPU allocated"} for n in PLOTS]  # a CPU engine: no GPU line
        wait_for(lambda: sampler.latest is not None, 30, "the first sample")  # taken before the reply
        before = sampler.latest["stats"]

        async def reply():
            return [out async for out in llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))]
        asyncio.run(reply())
        assert sampler.sample() and sampler.sample()  # two samples, no step between them
        busy, idle = sampler.history[-2], sampler.history[-1]
        assert sampler.latest["stats"]["last_decode_tokens"] > 0  # what the engine last did ...
        assert idle["decode"] == idle["prefill"] == 0  # ... is not what it does now
        after = sampler.latest["stats"]
        steps = after["num_steps"] - before["num_steps"]
        assert steps >= 2 and busy["prefill"] * steps == 3  # the reply's steps on average: its 3-token prompt
        assert busy["decode"] * steps == after["decode_tokens_total"] - before["decode_tokens_total"] >= 3
    finally:
        llm.shutdown()
