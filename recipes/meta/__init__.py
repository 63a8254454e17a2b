"""MAML (second- or first-order, torchopt) through flashbob attention on generated few-shot sequence tasks."""
