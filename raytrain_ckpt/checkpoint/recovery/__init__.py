"""What a checkpoint holds and loading it back: from the node's RAM (a committed copy), a peer's replica,
or storage, with the per-rank memory-or-storage decision. Runs in trainers and the driver; imports every
room but ``roles`` and ``interchange``."""
