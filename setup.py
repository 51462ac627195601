"""Shim for `python setup.py ...` and older tools: the metadata is all in pyproject.toml."""

from setuptools import setup

setup()
