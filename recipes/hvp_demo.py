"""Smallest demonstration: an exact Hessian-vector product through flashbob attention.

Run ``python -m recipes.hvp_demo``. A causal self-attention layer (that of
:mod:`recipes.common.transformer`, with rotary positions) is trained for a few steps of next-step
regression on a random sequence; then the Hessian of its loss is applied to a random direction
twice, through flashbob (reverse-over-reverse, using the closed-form backward-over-backward) and
through naive materialised attention, and the two are compared.
"""

from __future__ import annotations

import argparse
import time

import torch

from recipes.common.transformer import SelfAttention, attention_function


def hessian_vector_product(model, x, target, vec):
    """``H v`` of the mean-squared next-step loss w.r.t. the model's parameters."""
    params = list(model.parameters())
    loss = torch.nn.functional.mse_loss(model(x), target)
    grads = torch.autograd.grad(loss, params, create_graph=True)
    return torch.autograd.grad(grads, params, vec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=256, help="sequence length")
    parser.add_argument("--dim", type=int, default=32, help="model width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = SelfAttention(args.dim, args.heads, args.heads, causal=True, rope_base=10000.0,
                          attend=attention_function("auto"), out_gain=1.0).to(device, torch.float64)
    sequence = torch.randn(1, args.length + 1, args.dim, device=device, dtype=torch.float64).cumsum(1) / args.length**0.5
    x, target = sequence[:, :-1], sequence[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), target).backward()
        opt.step()

    vec = [torch.randn_like(p) for p in model.parameters()]
    start = time.perf_counter()
    hv = hessian_vector_product(model, x, target, vec)
    elapsed = time.perf_counter() - start
    model.attend = attention_function("eager")
    hv_naive = hessian_vector_product(model, x, target, vec)
    flat, flat_naive = torch.cat([h.flatten() for h in hv]), torch.cat([h.flatten() for h in hv_naive])
    error = ((flat - flat_naive).norm() / flat_naive.norm()).item()
    print(f"device={device} length={args.length} dim={args.dim} heads={args.heads}")
    print(f"flashbob HVP in {elapsed * 1e3:.1f} ms; v.Hv = {torch.dot(flat, torch.cat([v.flatten() for v in vec])).item():.6g}")
    print(f"relative difference from naive attention: {error:.2e}")
    if not error < 1e-10:
        raise SystemExit(f"HVP mismatch: relative error {error:.2e}")


if __name__ == "__main__":
    main()
