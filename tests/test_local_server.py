"""The vLLM command line twinspark.vllm_plugin.local_server.LocalServer starts (no vLLM needed)."""

from __future__ import annotations

import argparse

from twinspark.vllm_plugin.local_server import LocalServer


def test_api_key_starting_with_a_dash_stays_its_value(tmp_path):
    """`secrets.token_urlsafe` keys (the demo's) start with '-' one time in 64; passed as an argument of its own,
    vLLM's parser took it for an option and exited with '--api-key: expected at least one argument'."""
    cmd = LocalServer(tmp_path, api_key="-Xy_9", log_path=str(tmp_path / "vllm.log")).command()
    parser = argparse.ArgumentParser()  # the option as vLLM declares it
    parser.add_argument("--api-key", nargs="+")
    args, _ = parser.parse_known_args(cmd[3:])
    assert args.api_key == ["-Xy_9"]


def test_no_api_key_no_option(tmp_path):
    cmd = LocalServer(tmp_path, log_path=str(tmp_path / "vllm.log")).command()
    assert not any(a.startswith("--api-key") for a in cmd)
