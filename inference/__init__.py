"""The bundled inference process: an aiohttp server around a torch model that concurrency cannot OOM.

Importing this package does not import torch; the modules that need it do.
"""
