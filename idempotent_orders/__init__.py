"""Idempotent order workflows for Django."""

__version__ = "0.1.0"
