"""Triton Python-backend entry point written by `lmforge export` (encoder).

The serving code lives in the installed lmforge (deploy.triton_encoder); this file only points Triton at it.
"""

from deploy.triton_encoder import TritonPythonModel  # noqa: F401
