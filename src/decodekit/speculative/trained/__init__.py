"""Trained drafters: networks (EAGLE, Medusa, Hydra), self-distilled data, training, and their files.

The drafters that use them are ``speculative/drafters/eagle.py``, ``medusa.py`` and ``hydra.py``; the command
that makes them is ``decodekit train-drafter`` (``interfaces/cli.py``).
"""
