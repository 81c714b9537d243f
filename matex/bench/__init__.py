"""``python -m matex.bench RECIPE``: benchmark recipes (see ``matex.science.recipe``)."""
