"""The live panel's sampler on a real engine: every open panel asks it every second, and each
sample is rendered once for all of them."""
import pytest

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from tests.serving import wait_for
from ui.panel import PLOTS, PanelSampler

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
