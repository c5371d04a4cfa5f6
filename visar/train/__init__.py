"""Training: the recipes that reproduce visar's embedded models on the shapes world, and their loops.

recipes.py (one base recipe plus each model's overrides), loop.py (what every trainer shares),
raster.py (LlamaGen and its VQ), masked.py (MaskGIT), next_scale.py (VAR and its multi-scale VQVAE),
continuous.py (MAR and its KL VAE). `visar train` (visar/apps/commands/train.py) runs them; how:
docs/TRAINING.md.
"""
