"""The spectrum recipe on the LM recipe's micro run (CPU): its CSVs and plots, Adam's preconditioner against
torch's AdamW step, and its command-line errors."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from recipes.lm.train import train
from recipes.spectrum import sharpness
from recipes.spectrum.__main__ import main
from tests.runs import LM

SMALL = ["--k", "2", "--ncv", "8", "--repeats", "1", "--points", "32", "--trace-products", "6", "--tol", "1e-2",
         "--threads", "1", "--device", "cpu", "--quiet"]


def read(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_spectra_of_an_adamw_run_at_two_lengths_and_two_steps(tmp_path):
    train(LM.config(tmp_path, "train.steps=4", "train.checkpoint_interval=2", "train.eval_interval=4",
                    "train.threads=1"))
    run = tmp_path / "tiny"
    outputs = main(["--run", str(run), "--lengths", "8", "16", "--sharpness", "--out", str(tmp_path / "out"), *SMALL])
    rows = read(outputs["spectrum"])
    assert [(r["step"], r["length"], r["curvature"]) for r in rows] == [
        (step, length, kind) for step in ("2", "4") for length in ("8", "16") for kind in ("hessian", "ggn")]
    numbers = ["loss", "eigenvalue_1", "eigenvalue_2", "trace_hutchpp", "trace_slq", "second_moment_slq",
               "eigen_products", "eigen_seconds", "eigen_product_seconds", "trace_products", "density_products"]
    for row in rows:
        assert all(math.isfinite(float(row[key])) for key in numbers), row
        assert float(row["eigenvalue_1"]) >= float(row["eigenvalue_2"])
        assert int(row["trace_products"]) == 6 and int(row["eigen_products"]) > 0
        if row["curvature"] == "ggn":  # positive semi-definite
            assert float(row["eigenvalue_2"]) > 0 and float(row["lambda_min_estimate"]) == 0
    density = read(outputs["density"])
    assert len(density) == len(rows) * 32
    assert all(float(r["density"]) >= 0 and math.isfinite(float(r["eigenvalue"])) for r in density)
    edge = read(outputs["sharpness"])
    assert [r["step"] for r in edge] == ["2", "4"] and all(r["length"] == "64" for r in edge)
    for r in edge:
        assert float(r["threshold"]) == pytest.approx(38) and float(r["preconditioned_sharpness"]) > 0
        assert math.isfinite(float(r["top_eigenvalue"])) and float(r["lr"]) > 0
    for label in ("density plot (hessian)", "density plot (ggn)", "plot", "sharpness plot"):
        assert outputs[label].suffix == ".png" and outputs[label].stat().st_size > 1000


def test_adam_preconditioner_gives_torch_adamws_step():
    """AdamW's step (no weight decay) is -P^{-1} m with P^{-1} = lr / ((1 - beta1^t)(sqrt(v_hat) + eps))."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4, generator=generator, dtype=torch.float64))]
    opt = torch.optim.AdamW(params, lr=0.1, betas=(0.8, 0.95), eps=1e-3, weight_decay=0.0)
    for _ in range(3):
        before = params[0].detach().clone()
        params[0].grad = torch.randn(3, 4, generator=generator, dtype=torch.float64)
        opt.step()
    (inverse,) = sharpness.inverse_preconditioner(opt, params)
    torch.testing.assert_close(before - params[0].detach(), inverse * opt.state[params[0]]["exp_avg"])
    assert sharpness.threshold(0.9) == pytest.approx(38)


def test_bad_options_exit_with_a_message_naming_them(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--run", str(tmp_path), *SMALL])
    assert exit_.value.code == 2
    assert "--run " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--run", str(tmp_path), "--trace-products", "10"])
    assert "--trace-products must be a multiple of 3" in capsys.readouterr().err
