"""The commands of ``raytrain-ckpt`` (``main.py``: the parser and ``run``/``validate``/``schema``/``export``/``import``;
the others one command family each). Runs in the user's shell; may import every other room.
"""
