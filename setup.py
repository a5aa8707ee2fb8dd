"""Build script. Package metadata lives in pyproject.toml; native kernels are added here."""

from setuptools import setup

setup()
