"""Decode-side options SGLang 0.5.23 refuses for DeepSeek-V4 on this machine, so the rig
cannot run them (docs/rig.md): shown by starting SGLang's own decode server with them.
Should a release accept one, its test fails and the rig can cover the option."""

from __future__ import annotations

import os
import subprocess

import pytest

from dsv4_idxk_probe.testbed.sglang import launch

REFUSALS = {
    # HiCache on decode (and so host-receive decode, which needs it): SWA models only
    # keep a device-resident decode radix cache
    "hicache": (launch.ServerOptions(decode_hicache=True, decode_host_receive_threshold=0.5),
                r"sliding window attention (SWA) models currently supports only device-resident cache"),
    # the decode radix cache itself: DeepSeek-V4 needs the unified KV layout, a ROCm-only path
    "radix": (launch.ServerOptions(decode_radix_cache=True),
              r"--disaggregation-decode-enable-radix-cache with DeepSeek-V4 requires the unified KV layout"),
}


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_sglang_refuses_the_option_on_a_deepseek_v4_decode_server(tmp_path, name):
    options, message = REFUSALS[name]
    model = launch.write_model_dir(tmp_path / "model")
    args = launch.server_args("decode", model, launch.Ports.free(), options)
    env = launch.server_env(dict(os.environ), launch.rig_plugin_site(tmp_path / "site"), tmp_path, "decode")
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and message in text, text[-3000:]
