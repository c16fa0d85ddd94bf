"""Replicas: the replicate dimension's quorum and its heal from a live peer (torchft).

``lighthouse``: torchft's quorum server in a Ray actor of its own, on the head node.
``sync``: one rank's side of the replicate dimension: the step's quorum, the gradients averaged
across the replicas that take part, the commit vote, and the heal (parameters and optimizer state
received from a live replica, never from storage).

torchft is an optional dependency (``pip install -e ".[replicas]"``); nothing else in the package
imports this room unless a job asks for replicas.
"""
