"""Trained drafters: networks (EAGLE, Medusa), self-distilled data, training, and their files.

The drafters that use them are ``speculative/drafters/eagle.py`` and ``medusa.py``; the command
that makes them is ``decodekit train-drafter`` (``interfaces/cli.py``).
"""
