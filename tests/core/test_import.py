"""The core needs only torch: ``import chunkstar`` (and a training step) work with
transformers, deepspeed, pandas, streamlit and plotly made unimportable."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKED = ("transformers", "deepspeed", "pandas", "streamlit", "plotly")

SCRIPT = textwrap.dedent(
    f"""
    import sys
    for name in {BLOCKED!r}:
        sys.modules[name] = None  # "import name" now raises ModuleNotFoundError

    import torch
    import chunkstar

    for name in ("initialize_engine", "ConfigError", "DeviceMemoryError"):
        assert hasattr(chunkstar, name), name

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))

    engine, optimizer = chunkstar.initialize_engine(
        model_func=build, local_rank=0,
        config={{"device": "cpu", "device_memory_budget": "16MB", "optimizer": {{"type": "Adam"}}}},
    )
    loss = engine(torch.randn(4, 8)).square().mean()
    engine.backward(loss)
    optimizer.step()
    optimizer.zero_grad()

    loaded = sorted(n for n in {BLOCKED!r} if sys.modules.get(n) is not None)
    assert not loaded, loaded
    print("ok")
    """
)


def test_core_imports_and_trains_without_extras() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"import chunkstar without the extras failed:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("ok"), proc.stdout
