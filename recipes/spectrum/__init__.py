"""Hessian and Gauss-Newton spectra of a trained language model: ``python -m recipes.spectrum``."""
