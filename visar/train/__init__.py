"""Training: the recipes that reproduce visar's embedded models, and their loops (`visar train`)."""
