"""Metadata lives in setup.cfg."""

import setuptools

setuptools.setup()
