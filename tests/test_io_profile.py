"""The models and the verdict of benchmarks/io_profile.py (the ncu run itself needs a GPU)."""

import pytest

from benchmarks import io_profile
from flashbob.kernels import configs


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kernel", ["forward", "bob_cols"])
def test_streaming_model_counts_one_full_read_of_the_streamed_side_per_extra_program(kernel, causal):
    n, heads, head_dim, itemsize, block = 1000, 3, 64, 2, 128
    launch = {"kernel": kernel, "argument_bytes": 12345, "head_dim": head_dim, "itemsize": itemsize,
              "block_m": block if kernel == "forward" else 16, "block_n": block if kernel == "bob_cols" else 16}
    streamed = configs._FOOTPRINT[kernel][3]
    programs = 8  # ceil(1000 / 128)
    rereads = (programs - 1) * streamed * n * head_dim * itemsize * heads
    want = 12345 + rereads * (0.5 if causal else 1.0)
    assert io_profile.model_bytes(launch, n, heads, causal) == want


@pytest.mark.parametrize("dram,tensor,verdict", [(80, 20, "memory"), (55, 60, "matrix units"),
                                                 (10, 70, "matrix units"), (10, 30, "latency"), (60, 60, "memory")])
def test_bound(dram, tensor, verdict):
    assert io_profile.bound(dram, tensor) == verdict
