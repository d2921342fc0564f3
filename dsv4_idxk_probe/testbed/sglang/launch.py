"""Start and stop SGLang's own prefill server, decode server and router on loopback.

Command lines and environment follow the measured recipe (docs/rig.md):
``python -m sglang.launch_server`` per role with ``--device cpu --load-format
dummy --skip-tokenizer-init`` on a tiny DeepSeek-V4 config (`write_model_dir`),
NIXL as the transfer backend, and ``sglang_router.launch_router`` in PD mode
in front. Every process gets its own session (so a stop reaches its
children) and its own log file in the run folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

from ...vocabulary import PAGE_TOKENS
from .env import ENV_RIG, ENV_ROLE

#: A DeepSeek-V4 small enough for two CPU cores; C4 layers are 1 and 3.
MODEL_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 256,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "q_lora_rank": 128,
    "kv_lora_rank": 512, "qk_nope_head_dim": 448, "qk_rope_head_dim": 64, "head_dim": 512,
    "v_head_dim": 512, "index_head_dim": 128, "index_n_heads": 4, "index_topk": 512,
    "intermediate_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "o_lora_rank": 128, "o_groups": 2, "window_size": 128, "sliding_window": 128,
    "compress_ratios": [0, 4, 128, 4], "vocab_size": 1024, "max_position_embeddings": 8192,
    "n_hash_layers": 0, "hc_mult": 1, "torch_dtype": "bfloat16", "bos_token_id": 0,
    "eos_token_id": 1, "rope_theta": 10000, "rope_scaling": {},
}
PAGE_SIZE = PAGE_TOKENS
VOCAB = MODEL_CONFIG["vocab_size"]
#: The index-K row layout the stand-in's pool holds (fp8 payload and a float32 scale per slot).
INDEX_K_LAYOUT = "fp8"
#: A DeepSeek-V4.1-shaped stand-in (``ServerOptions(model="v41")``): C4 layers 1 and 3, a
#: ratio-1 layer 4 and a ratio-2 layer 5, each its own kv_source, so SGLang's pool has
#: ``index_pools`` {4: fp8, 1: fp4, 2: fp4} (model_type deepseek_v41: the V4 config refuses
#: ratios 1 and 2). No C128 layer (layer 2 is SWA only): SGLang 0.5.23's PD send asserts
#: "request-scoped state pools must share one ring layout" for a model with both C128 and
#: ratio-2 layers (their state rings differ: 128 and 2 rows), whatever the probe does.
MODEL_CONFIG_V41 = {
    **MODEL_CONFIG, "model_type": "deepseek_v41", "num_hidden_layers": 6,
    "compress_ratios": [0, 4, 0, 4, 1, 2], "kv_source_layer_ids": [4, 5],
}
MODEL_CONFIGS = {"v4": MODEL_CONFIG, "v41": MODEL_CONFIG_V41}


def c4_layer_ids() -> list[int]:
    """The global ids of the model's C4 layers (those whose index-K the probe digests)."""
    from ...vocabulary import C4_RATIO

    return [layer for layer, ratio in enumerate(MODEL_CONFIG["compress_ratios"]) if ratio == C4_RATIO]


class LaunchError(RuntimeError):
    """A server did not come up; the message names it and the end of its log."""


class PortTaken(LaunchError):
    """A port the rig picked was taken before the server bound it (started again on others)."""


@dataclass(frozen=True)
class ServerOptions:
    """What differs between the rig's server pairs (each maps to SGLang flags)."""

    overlap: bool = False  # SGLang's overlap event loops (both roles)
    chunked_prefill_size: int = 1024
    max_running_requests: int = 8
    max_total_tokens: int = 65536
    # --disaggregation-decode-enable-radix-cache (decode prefix hits): SGLang 0.5.23 refuses it for
    # DeepSeek-V4 off ROCm (it needs the unified KV layout, a HIP-only path); kept to show the refusal
    decode_radix_cache: bool = False
    prefill_hicache: bool = False  # --enable-hierarchical-cache on prefill
    decode_hicache: bool = False  # HiCache on decode (needed by host-receive; implies the decode radix cache)
    decode_host_receive_threshold: float | None = None  # --disaggregation-decode-host-receive-threshold
    hicache_io_backend: str = "direct"  # with layer_first: the one copy cpu_patches can stand in for
    hicache_mem_layout: str = "layer_first"
    hicache_ratio: float = 2.0
    extra_prefill: tuple[str, ...] = ()
    extra_decode: tuple[str, ...] = ()
    model: str = "v4"  # or "v41": MODEL_CONFIGS
    prefill_env: tuple[tuple[str, str], ...] = ()  # (name, value) set in prefill's environment
    # topologies (docs/rig.md "Topologies"): each extra rank is a process on the CPU (gloo)
    transfer_backend: str = "nixl"  # or "mooncake" (its TCP transport: MOONCAKE_PROTOCOL=tcp)
    prefill_tp: int = 1
    decode_tp: int = 1
    prefill_pp: int = 1
    decode_pp: int = 1
    prefill_dp: int = 1  # attention DP width (--attn-dp-size), inside the TP group
    decode_dp: int = 1
    # where each role listens: None for loopback; a `netns.Hosts` puts each role in its own
    # network namespace, on its own routable address (the router runs beside decode)
    hosts: Any = None

    def ranks(self, role: str) -> int:
        """The scheduler processes `role` runs (attention DP ranks live inside the TP group)."""
        if role == "prefill":
            return self.prefill_tp * self.prefill_pp
        return self.decode_tp * self.decode_pp if role == "decode" else 1

    def parallel_args(self, role: str) -> list[str]:
        tp, pp, dp = ((self.prefill_tp, self.prefill_pp, self.prefill_dp) if role == "prefill"
                      else (self.decode_tp, self.decode_pp, self.decode_dp))
        args = []
        if tp != 1:
            args += ["--tp-size", str(tp)]
        if pp != 1:
            args += ["--pp-size", str(pp)]
        if dp != 1:  # 0.5.23's spelling of --dp-size N --enable-dp-attention
            args += ["--attn-dp-size", str(dp)]
        return args


@dataclass
class Ports:
    prefill: int
    decode: int
    bootstrap: int
    router: int
    router_metrics: int  # the router's own Prometheus exporter (29000 unless told; two rigs would collide)

    @classmethod
    def free(cls) -> "Ports":
        return cls(*free_ports(5))


@dataclass
class Cluster:
    """The running processes of one rig pair and where they write."""

    run_dir: Path
    ports: Ports
    options: ServerOptions
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.router}"

    def server_url(self, role: str) -> str:
        return f"http://{role_host(self.options, role)}:{getattr(self.ports, role)}"

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.logs.get(name)
        if path is None or not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            return "\n".join(f.read().decode("utf-8", "replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left."""
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


#: Ports the rig picks from: below Linux's ephemeral range (32768-60999), where SGLang's own
#: processes take the ports they bind to port 0, so a picked port is not taken in the meantime.
PORT_RANGE = (20000, 32000)


def free_ports(n: int, avoid: Collection[int] = ()) -> list[int]:
    """`n` distinct loopback ports that are free now, drawn from PORT_RANGE, none in `avoid`."""
    import random

    picked: list[int] = []
    while len(picked) < n:
        port = random.randrange(*PORT_RANGE)
        if port in picked or port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        picked.append(port)
    return picked


def write_model_dir(path: Path, model: str = "v4") -> Path:
    if model not in MODEL_CONFIGS:
        raise ValueError(f"unknown rig model {model!r}; known: {sorted(MODEL_CONFIGS)}")
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIGS[model], indent=1))
    return path


def rig_plugin_site(path: Path) -> Path:
    """A folder holding only an entry point (``sglang.srt.plugins``) for the rig's plugin."""
    dist = path / "dsv4_idxk_probe_rig-0.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dsv4-idxk-probe-rig\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\ndsv4_idxk_probe_rig = dsv4_idxk_probe.testbed.sglang.plugin:load\n"
        "dsv4_idxk_probe_rig_deferral = dsv4_idxk_probe.testbed.sglang.deferral:load\n"
    )
    return path


def role_host(opts: ServerOptions, role: str) -> str:
    """The address `role` listens on and advertises: loopback, or its namespace's (`netns.Hosts`)."""
    return "127.0.0.1" if opts.hosts is None or role == "router" else opts.hosts.role_host(role)


def server_args(role: str, model_dir: Path, ports: Ports, opts: ServerOptions) -> list[str]:
    args = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--device", "cpu",
        "--load-format", "dummy", "--skip-tokenizer-init", "--host", role_host(opts, role),
        "--disaggregation-transfer-backend", opts.transfer_backend, "--page-size", str(PAGE_SIZE),
        "--disable-cuda-graph", *opts.parallel_args(role),
        "--chunked-prefill-size", str(opts.chunked_prefill_size),
        "--max-running-requests", str(opts.max_running_requests),
        "--max-total-tokens", str(opts.max_total_tokens), "--swa-full-tokens-ratio", "0.5",
        "--enable-metrics", "--disaggregation-mode", role, "--port", str(getattr(ports, role)),
    ]
    if not opts.overlap:
        args.append("--disable-overlap-schedule")
    hicache = opts.prefill_hicache if role == "prefill" else opts.decode_hicache
    if hicache:
        args += ["--enable-hierarchical-cache", "--hicache-io-backend", opts.hicache_io_backend,
                 "--hicache-mem-layout", opts.hicache_mem_layout, "--hicache-ratio", str(opts.hicache_ratio)]
    if role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(ports.bootstrap), *opts.extra_prefill]
    else:
        if opts.decode_radix_cache or opts.decode_hicache:
            args.append("--disaggregation-decode-enable-radix-cache")
        if opts.decode_host_receive_threshold is not None:
            args += ["--disaggregation-decode-host-receive-threshold", str(opts.decode_host_receive_threshold)]
        args += list(opts.extra_decode)
    return args


def router_args(ports: Ports, opts: ServerOptions | None = None) -> list[str]:
    opts = opts or ServerOptions()
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", f"http://{role_host(opts, 'prefill')}:{ports.prefill}", str(ports.bootstrap),
        "--decode", f"http://{role_host(opts, 'decode')}:{ports.decode}", "--host", "127.0.0.1",
        "--port", str(ports.router),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(ports.router_metrics),
        # it starts before the servers are up: look for them every second, not every 30
        "--worker-startup-check-interval", "1",
    ]


def server_env(base: dict[str, str], plugin_site: Path, metrics_dir: Path, role: str,
               opts: ServerOptions | None = None) -> dict[str, str]:
    opts = opts or ServerOptions()
    env = dict(base)
    path = [str(plugin_site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update({
        "PYTHONPATH": os.pathsep.join(path),
        ENV_RIG: "1",
        ENV_ROLE: role,
        "SGLANG_HOST_IP": role_host(opts, role),  # else the KV manager advertises the routable address
        "UCX_NET_DEVICES": "lo" if opts.hosts is None or role == "router" else opts.hosts.role_device(role),
        "SGLANG_FORCE_COARSE_WAR_BARRIER": "1",  # the stand-in has no DSV4 attention metadata
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0",
        # A stop signals every process; a server whose scheduler dies first takes it for a crash
        # and sleeps 5 s before its py-spy and CUDA-coredump diagnostics (neither exists here)
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    if opts.transfer_backend == "mooncake":
        env["MOONCAKE_PROTOCOL"] = "tcp"  # no RDMA device here: Mooncake's TCP transport
    if role == "prefill":
        env.update(dict(opts.prefill_env))
    ranks = opts.ranks(role)
    if ranks > 1:  # SGLang's CPU path binds each rank to a NUMA node unless told which cores it gets
        cores = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % cores) for i in range(ranks))
        # the test venv's torch is a CUDA build, so SGLang finds NCCL and builds a CUDA communicator
        # for the group ("Expected a cuda device, but got: cpu"); a CPU-only torch has no NCCL,
        # and SGLang then keeps gloo alone: point it at a library that does not exist, as there
        env["SGLANG_NCCL_SO_PATH"] = "libnccl-absent-on-cpu.so"
    return env


def start(run_dir: Path, opts: ServerOptions, env: dict[str, str], *, timeout_s: float = 240.0,
          ports: Ports | None = None, attempts: int = 3) -> Cluster:
    """Both servers and the router, healthy; LaunchError (everything stopped) otherwise.
    A port taken meanwhile costs a start on other ports, `attempts` times at most."""
    for attempt in range(attempts):
        try:
            return _start(run_dir, opts, env, timeout_s=timeout_s, ports=ports if attempt == 0 else None)
        except PortTaken:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _start(run_dir: Path, opts: ServerOptions, env: dict[str, str], *, timeout_s: float, ports: Ports | None) -> Cluster:
    run_dir.mkdir(parents=True, exist_ok=True)
    ports = ports or Ports.free()
    model_dir = write_model_dir(run_dir / "model", opts.model)
    site = rig_plugin_site(run_dir / "rig-site")
    cluster = Cluster(run_dir, ports, opts)
    try:
        for role in ("prefill", "decode"):
            metrics = run_dir / f"metrics-{role}"
            metrics.mkdir(exist_ok=True)
            _spawn(cluster, role, server_args(role, model_dir, ports, opts), server_env(env, site, metrics, role, opts))
        # The router starts beside the servers, not after them: its import alone takes ~9 s of
        # CPU, and once the servers are up their idle schedulers poll for work, so on two
        # cores a router started then took 12 s (one rank a side) to 114 s (two) to start.
        (run_dir / "metrics-router").mkdir(exist_ok=True)
        router_env = server_env(env, site, run_dir / "metrics-router", "router", opts)
        _spawn(cluster, "router", router_args(ports, opts), router_env)
        deadline = time.monotonic() + timeout_s
        for role in ("prefill", "decode"):
            _wait_http(cluster, role, cluster.server_url(role) + "/health", deadline)
        _start_router(cluster, router_env, deadline, spawned=True)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _start_router(cluster: Cluster, env: dict[str, str], deadline: float, attempts: int = 3,
                  spawned: bool = False) -> None:
    """The router, ready; `spawned`: its first start is already on its way. Its ports were
    picked up to a minute before it binds them: one taken meanwhile costs the router (not the
    servers) a start on two other ports, `attempts` times at most."""
    for attempt in range(attempts):
        if attempt > 0 or not spawned:
            _spawn(cluster, "router", router_args(cluster.ports, cluster.options), env)
        try:
            _wait_router(cluster, deadline)
            return
        except PortTaken:
            if attempt == attempts - 1:
                raise
            cluster.procs.pop("router").wait()
            taken = {cluster.ports.prefill, cluster.ports.decode, cluster.ports.bootstrap}
            cluster.ports.router, cluster.ports.router_metrics = free_ports(2, avoid=taken)


def _spawn(cluster: Cluster, name: str, args: list[str], env: dict[str, str]) -> None:
    log = cluster.run_dir / f"{name}.log"
    cluster.logs[name] = log
    if cluster.options.hosts is not None:
        args = cluster.options.hosts.wrap(name, args)
    with open(log, "wb") as out:  # a start on other ports begins the log afresh
        cluster.procs[name] = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=str(cluster.run_dir), start_new_session=True,
        )


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


#: What a server's or the router's log says when a port it was given is taken.
BIND_FAILED = ("error while attempting to bind on address", "Address already in use")


def _bind_failed(log_tail: str) -> bool:
    return any(sign in log_tail for sign in BIND_FAILED)


def _wait_http(cluster: Cluster, name: str, url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        proc = cluster.procs[name]
        exited = proc.poll() is not None
        tail = cluster.log_tail(name, 30 if exited else 5)
        if _bind_failed(tail):  # uvicorn's port, or (exited) the bootstrap server's
            raise PortTaken(f"{name} server could not bind its port:\n{tail}")
        if exited:
            raise LaunchError(f"{name} server exited ({proc.returncode}) before it was healthy:\n{tail}")
        try:
            if http_get(url, timeout=2.0)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise LaunchError(f"{name} server not healthy at {url} in time:\n{cluster.log_tail(name)}")


def _wait_router(cluster: Cluster, deadline: float) -> None:
    """The router registers workers in the background: wait until both are listed healthy."""
    while time.monotonic() < deadline:
        if cluster.procs["router"].poll() is not None:
            tail = cluster.log_tail("router")
            if _bind_failed(tail):
                raise PortTaken(f"router could not bind its port:\n{tail}")
            raise LaunchError(f"router exited before it was ready:\n{tail}")
        try:
            status, body = http_get(cluster.url + "/workers", timeout=2.0)
            if status == 200 and _workers_ready(body):
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise LaunchError(f"router has no healthy prefill and decode workers in time:\n{cluster.log_tail('router')}")


def _workers_ready(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    workers = data.get("workers", data) if isinstance(data, dict) else data
    if not isinstance(workers, list):
        return False
    kinds = set()
    for w in workers:
        if isinstance(w, dict) and w.get("is_healthy", w.get("healthy", True)):
            kinds.add(str(w.get("worker_type", w.get("type", ""))).lower())
    return any("prefill" in k for k in kinds) and any("decode" in k for k in kinds)
