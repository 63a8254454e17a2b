"""Command line of the TTT recipe: ``python -m recipes.ttt --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

from recipes.common import cli
from recipes.ttt.train import load_config, train


def main(argv: list[str] | None = None) -> dict[str, float]:
    return cli.run("ttt", "Meta-learn test-time training of a byte-level LM on flashbob.", load_config, train,
                   lambda key: key.startswith("val/"), argv)


if __name__ == "__main__":
    main()
