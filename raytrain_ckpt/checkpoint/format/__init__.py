"""What a valid step is: entry names and kinds, the manifest, checksums, ``verify_step``, and reading
DCP's ``.metadata`` without running it. Runs in any process; imports nothing else of ``checkpoint/``
(``records`` and ``errors`` aside), so every other room may depend on it."""
