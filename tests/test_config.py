"""EngineConfig's fields are the engine's flags: defaults, choices and help written once; the
environment is read in engine.config alone."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from engine.config import EngineConfig, add_engine_args, config_from_args, knobs


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def test_every_field_has_a_flag_with_its_default():
    args = parser().parse_args([])
    for f in dataclasses.fields(EngineConfig):
        assert getattr(args, f.name) == f.default, f.name
    assert config_from_args(args) == EngineConfig()


def test_flags_set_their_fields():
    args = parser().parse_args(["--no-prefix-caching", "--no-int8-activations", "--threads", "1",
                                "--block-size", "32", "--kv-disk-bytes", "512M", "--logprobs-mode",
                                "processed_logprobs", "--max-model-len", "256"])
    config = config_from_args(args)
    assert (config.enable_prefix_caching, config.int8_activations, config.num_threads) == (False, False, 1)
    assert (config.block_size, config.kv_disk_bytes, config.max_model_len) == (32, 512 * 2**20, 256)
    assert config.logprobs_mode == "processed_logprobs"


@pytest.mark.parametrize("argv", [["--block-size", "8"], ["--dtype", "int3"], ["--kv-disk-bytes", "lots"],
                                  ["--max-num-seqs", "many"]])
def test_bad_flags_are_refused_by_the_parser(argv, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_help_shows_defaults_and_switches_say_what_they_turn_off():
    text = parser().format_help()
    assert "(default: 1024)" in text  # --max-num-batched-tokens
    assert "turn off: reuse the KV blocks of shared prefixes" in " ".join(text.split())


def test_knobs_read_the_environment_now(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDCHAT_CACHE", str(tmp_path))
    monkeypatch.setenv("PAGEDCHAT_NO_PACKING", "1")
    monkeypatch.delenv("PAGEDCHAT_API_KEY", raising=False)
    k = knobs()
    assert (k.cache, k.no_packing, k.api_key) == (str(tmp_path), True, None)
    monkeypatch.delenv("PAGEDCHAT_NO_PACKING")
    assert not knobs().no_packing
