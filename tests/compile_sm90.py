"""Compile flashbob's Triton kernels for Hopper (sm_90) without a GPU, to find compile errors that Triton's
interpreter cannot show (its pipeliner, its tensor-descriptor lowering).

    TRITON_INTERPRET=0 python tests/compile_sm90.py ENTRY ... [--n N] [--m M] [--heads H] [--kv-heads HKV] [--causal]
        [--masks]

Each ENTRY (``forward``, ``backward``, ``bob``, ``forward_jvp``, ``backward_jvp``) is called on CPU tensors while a
stand-in driver reports an sm_90 target and every launch only compiles (Triton's ``warmup``), so that every kernel
the entry launches goes through Triton's whole CUDA pipeline down to ptxas. ``--masks`` adds every other mask at once
(a window, document ids, a key mask and a block mask's tiles), so that their code compiles too. Prints one line per entry, ``ok`` or
``FAILED`` with the error; exits 1 if any failed. ``FLASHBOB_KERNEL_VARIANT`` picks the code path as usual.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
os.environ.setdefault("FLASHBOB_AUTOTUNE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class Hopper:
    """The parts of Triton's active driver that compiling asks for: an sm_90 target, device 0, stream 0."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_only() -> None:
    """Every launch compiles its kernel and returns without running it."""
    run = JITFunction.run

    def warmup(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = warmup


def mask_flags(n: int, m: int) -> dict:
    """A window, document ids, a key mask and a block mask's tiles for ``n`` queries and ``m`` keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    from flashbob import masks

    block_mask = create_block_mask(lambda b, h, i, j: (i + j) % 3 != 0, None, None, n, m, device="cpu",
                                   BLOCK_SIZE=(16, 16))
    tile_state, tile_bits = masks._tiles(block_mask, n, m, "cpu")
    return {"window": (5, 3), "q_ids": torch.arange(n)[None] // 7, "k_ids": torch.arange(m)[None] // 5,
            "key_mask": torch.arange(m)[None] % 4 != 1, "tile_state": tile_state, "tile_bits": tile_bits}


def entries(n: int, m: int, heads: int, kv_heads: int, causal: bool, dtype: torch.dtype, head_dim: int = 64,
            with_masks: bool = False):
    """Each entry point of flashbob.kernels as a call on random CPU tensors of these sizes."""
    from flashbob import kernels

    q, do, o, q_bar = (torch.randn(1, heads, n, head_dim).to(dtype) for _ in range(4))
    k, v, k_bar, v_bar = (torch.randn(1, kv_heads, m, head_dim).to(dtype) for _ in range(4))
    stats, delta = torch.zeros(1, heads, 2, n), torch.zeros(1, heads, n)
    flags = {"causal": causal, "scale": head_dim**-0.5, **(mask_flags(n, m) if with_masks else {})}
    return {
        "forward": lambda: kernels.forward(q, k, v, **flags),
        "backward": lambda: kernels.backward(q, k, v, o, stats, do, **flags),
        "bob": lambda: kernels.bob(q, k, v, do, o, stats, delta, q_bar, k_bar, v_bar, **flags),
        "forward_jvp": lambda: kernels.forward_jvp(q, k, v, o, stats, q_bar, k_bar, v_bar, **flags),
        "backward_jvp": lambda: kernels.backward_jvp(q, k, v, do, o, stats, delta, q_bar, k_bar, v_bar, do, **flags),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("entries", nargs="+", choices=("forward", "backward", "bob", "forward_jvp", "backward_jvp"))
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--m", type=int, default=45)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--masks", action="store_true", help="a window, documents, a key mask and a block mask too")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)

    driver.set_active(Hopper())
    compile_only()
    from flashbob.kernels import configs

    configs.descriptors_usable = lambda tensors: bool(tensors)  # as on an sm_90 GPU with aligned operands
    calls = entries(args.n, args.m, args.heads, args.kv_heads, args.causal, getattr(torch, args.dtype),
                    with_masks=args.masks)
    failed = 0
    for name in args.entries:
        try:
            calls[name]()
            print(f"{name}: ok", flush=True)
        except Exception as error:  # noqa: BLE001 - reported, then the exit status says it
            failed += 1
            print(f"{name}: FAILED {type(error).__name__}: {str(error)[:300]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
