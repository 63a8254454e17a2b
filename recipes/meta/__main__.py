"""Command line of the MAML recipe: ``python -m recipes.meta --config FILE [--resume PATH|auto] [key=value ...]``."""

from __future__ import annotations

from recipes.common import cli
from recipes.meta.train import load_config, train


def main(argv: list[str] | None = None) -> dict[str, float]:
    return cli.run("meta", "Meta-train a transformer with MAML through flashbob attention.", load_config, train,
                   lambda key: key.startswith("meta_test/") or key == "meta_train/query_loss", argv)


if __name__ == "__main__":
    main()
