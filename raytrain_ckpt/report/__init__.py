"""What a job and its checkpoints look like from outside: the inventory, a job's status and record,
which cluster to ask. Read by the CLI's ``status``/``ls``/``verify``; the driver writes the record.
"""
