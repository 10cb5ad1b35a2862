"""Placeholder; filled in below."""
