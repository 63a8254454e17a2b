"""Long-context language-model pretraining on flashbob attention (``python -m recipes.lm``)."""
