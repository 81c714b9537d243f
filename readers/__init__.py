"""Parallel readers for scientific files (HDF5, CSV, netCDF), sharded over ranks."""
