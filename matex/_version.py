"""MaTEx's version: the one place it is written.

``setup.py`` reads it by parsing this file (it must not import ``matex``,
whose dependencies may not be installed yet), and ``matex.__version__``
imports it.
"""

__version__ = "0.1.0"
