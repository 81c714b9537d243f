"""Keras 3 made distributed in place (``import matex.keras`` / ``python -m matex``).

One module per concern; ``install`` holds the patch table. Every private
Keras/TensorFlow access goes through ``matex._compat``.
"""
