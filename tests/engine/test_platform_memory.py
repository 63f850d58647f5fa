"""The engine keeps freed tensor memory in malloc's heap (``engine.platform.reuse_freed_tensor_memory``)."""

import os
import subprocess
import sys

import pytest

# A child process: an INT8 LM head of SmolLM2's shape with 32 outlier channels (its float32 outputs at 64 rows are
# 12.6 MB each), three warm-up calls, then the minor page faults of ten more calls of 64 rows.
HEAD_CALLS = """
import resource, sys, torch
from engine.platform import reuse_freed_tensor_memory
from engine.quant.int8 import W8A8Linear, quantize_weight_per_channel
print(reuse_freed_tensor_memory())
torch.manual_seed(0)
w8, scale = quantize_weight_per_channel(torch.randn(49152, 576) * 0.02)
head = W8A8Linear(w8, scale, None, outlier_channels=torch.arange(0, 576, 18))
x = torch.randn(64, 576).to(torch.bfloat16)
with torch.inference_mode():
    for _ in range(3):
        head(x)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        head(x)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(**env: str) -> tuple[str, int]:
    """(whether the setting was applied, page faults of the ten calls) in a fresh process."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GLIBC_TUNABLES", "MALLOC_"))}
    proc = subprocess.run(
        [sys.executable, "-c", HEAD_CALLS], capture_output=True, text=True, timeout=300, env={**base, **env}
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    applied, faults = proc.stdout.split()[-2:]
    return applied, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only")
def test_steps_reuse_freed_tensor_memory_instead_of_faulting_pages_in_again():
    applied, faults = _run()
    if applied == "False":
        pytest.skip("no glibc malloc to tune here")
    # one 12.6 MB float32 output mapped afresh is 3,072 pages of 4 KiB; untuned, the ten calls fault 61,000-153,000
    # pages in; kept, at most the heap's growth to its steady size (0 or one output's pages in runs here)
    assert applied == "True" and faults <= 2 * 3072, faults


def test_the_users_own_malloc_tuning_stands():
    applied, _ = _run(GLIBC_TUNABLES="glibc.malloc.perturb=0")
    assert applied == "False"
