"""Triton Python-backend entry point written by `lmforge export` (llm).

The serving code lives in the installed lmforge (deploy.triton_llm); this file only points Triton at it.
"""

from deploy.triton_llm import TritonPythonModel  # noqa: F401
