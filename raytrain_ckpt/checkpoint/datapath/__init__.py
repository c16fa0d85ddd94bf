"""The bytes' road from a trainer's tensors to storage: staging buffers in shared memory, the staging
copy and its progress, the ``ShardSink`` a writer runs (local file, S3 multipart upload, fsspec), and the
replica transport between nodes. Runs in trainers and node writers; imports ``format`` and ``storage``."""
