"""Helpers the tests share: processes and services, message builders, harnesses and scripts."""
