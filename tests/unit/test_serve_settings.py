"""Serve flags are defined once: the parser, the settings and the argv `up` gives its child agree."""

from __future__ import annotations

import argparse

import pytest

from gpu_watchdog.inference.settings import ServeSettings, SettingsError, add_flags, from_args, to_argv


def parse(argv: list[str], for_up: bool = False) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, for_up=for_up)
    return p.parse_args(argv)


def test_every_flag_round_trips_through_the_childs_argv() -> None:
    argv = ["--model", "/models/m", "--served-model-name", "llama", "--device", "cpu", "--port", "9000",
            "--control-port", "9001", "--max-concurrency", "6", "--max-batch-size", "12", "--queue-timeout", "2.5",
            "--max-queue", "9", "--max-tokens-limit", "64", "--body-timeout", "3", "--memory-fraction", "0.5",
            "--max-prefill-tokens", "512", "--prefix-cache", "256", "--fault-injection"]
    settings = from_args(parse(argv, for_up=True))
    assert settings.served_model_name == "llama" and settings.max_batch_size == 12 and settings.fault_injection
    assert settings.max_prefill_tokens == 512 and settings.prefix_cache_mib == 256
    child = from_args(parse(to_argv(settings)))
    assert child == settings


def test_defaults_need_no_flags_and_auto_stays_auto() -> None:
    settings = from_args(parse([]))
    assert settings == ServeSettings()
    assert to_argv(settings) == []
    assert from_args(parse(["--max-concurrency", "auto"])).max_concurrency is None


def test_the_retired_batch_window_flag_still_parses() -> None:
    settings = from_args(parse(["--batch-window-ms", "50"]))
    assert settings.batch_window_ms == 50.0
    assert to_argv(settings) == ["--batch-window-ms", "50.0"]


def test_up_leaves_out_the_flags_it_sets_itself() -> None:
    with pytest.raises(SystemExit):
        parse(["--token-file", "/tmp/t"], for_up=True)


def test_a_value_out_of_range_names_the_flag() -> None:
    with pytest.raises(SettingsError, match="--memory-fraction"):
        from_args(parse(["--memory-fraction", "1.5"]))
    with pytest.raises(SettingsError, match="--served-model-name"):
        from_args(parse(["--served-model-name", " "]))
    with pytest.raises(argparse.ArgumentError, match="max-batch-size"):
        parse(["--max-batch-size", "0"])
    with pytest.raises(argparse.ArgumentError, match="max-prefill-tokens"):
        parse(["--max-prefill-tokens", "0"])
    with pytest.raises(argparse.ArgumentError, match=r"prefix-cache.*MiB"):
        parse(["--prefix-cache", "-1"])
    with pytest.raises(argparse.ArgumentError, match=r"prefix-cache.*MiB"):
        parse(["--prefix-cache", "lots"])


def test_the_prefix_cache_is_off_at_zero_and_auto_by_default() -> None:
    assert from_args(parse(["--prefix-cache", "0"])).prefix_cache_mib == 0
    assert from_args(parse(["--prefix-cache", "auto"])).prefix_cache_mib is None


def test_the_handler_flags_round_trip_and_a_bad_handler_names_the_flag() -> None:
    argv = ["--handler", "embeddings", "--model", "/models/e5", "--batch-window-ms", "10", "--max-batch-tokens", "8192"]
    settings = from_args(parse(argv, for_up=True))
    assert settings.handler == "embeddings" and settings.max_batch_tokens == 8192
    assert from_args(parse(to_argv(settings))) == settings
    assert from_args(parse(["--handler", "my_pkg.models:Detector"])).handler == "my_pkg.models:Detector"
    for bad, words in ((["--handler", "reranker"], "--handler must be"), (["--handler", "classifier"], "--model DIR"),
                       (["--handler", "x:1y"], "--handler must be")):
        with pytest.raises(SettingsError, match=words):
            from_args(parse(bad))
